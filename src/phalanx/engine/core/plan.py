"""One engine step as a typed message: what every rank executes, and what rank 0 returns.

The parent's scheduler decides a step and encodes it once as a :class:`StepPlan`; every
rank receives the same bytes and issues the same collectives in the same order,
whatever its cache holds. Plans are msgspec structs (typed, bounded, no pickle):
:func:`encode_plan` / :func:`decode_plan` and :func:`encode_result` /
:func:`decode_result` are the only wire forms.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "PageCopy",
    "PageLoad",
    "PageSave",
    "SamplingSpec",
    "SeqChunk",
    "StepPlan",
    "StepResult",
    "TokenLogprobs",
    "decode_plan",
    "decode_result",
    "encode_plan",
    "encode_result",
]


class SamplingSpec(msgspec.Struct, frozen=True):
    """How rank 0 samples one sequence's next token at one step.

    ``seed`` (None: unseeded) and ``step_index`` (the index of the output token being
    drawn) seed a per-request generator, so a seeded request draws the same tokens
    whatever else is in the batch. ``logprobs``: how many top alternatives to return
    besides the chosen token (None: no logprobs). ``grammar``: the key of the grammar the
    token is drawn under (``engine/core/grammar.py``; None: unconstrained).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    logprobs: int | None = None
    step_index: int = 0
    grammar: str | None = None


class TokenLogprobs(msgspec.Struct, frozen=True):
    """The chosen token's logprob and the top-k alternatives (token id, logprob), best first."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = []


class SeqChunk(msgspec.Struct, frozen=True):
    """The tokens of one sequence computed at this step (a prefill chunk or a decode token)."""

    seq_id: int
    tokens: list[int]        # the tokens to compute this step
    start_pos: int           # position of tokens[0]; KV for positions < start_pos is in the pages
    block_table: list[int]   # page ids covering positions [0, start_pos + len(tokens))
    sample: bool             # True: return the next token (last prefill chunk, or decode)
    sampling: SamplingSpec = SamplingSpec()


class PageLoad(msgspec.Struct, frozen=True):
    """Disk tier -> KV pages, before the forward: record ``keys[i]`` into page ``page_ids[i]``."""

    keys: list[bytes]
    page_ids: list[int]


class PageCopy(msgspec.Struct, frozen=True):
    """KV page -> KV page, after the loads and before the forward: ``dst`` gets ``src``'s
    KV (a repeated prompt's partial tail, scheduler.py)."""

    src: int
    dst: int


class PageSave(msgspec.Struct, frozen=True):
    """KV pages -> disk tier, after the forward (staged, stored in the background)."""

    keys: list[bytes]
    page_ids: list[int]


class StepPlan(msgspec.Struct, frozen=True):
    """Everything every rank does at one step, in order: loads, copies, forward, saves.

    The grammar table (rank 0's, ``worker/grammar.py``; the parent mirrors it:
    ``core/grammar.py``'s GrammarTable): ``grammars`` key -> text, each sent once;
    ``grammar_drop`` keys to forget; ``grammar_done`` sequences whose matchers end."""

    step: int
    chunks: list[SeqChunk]
    loads: list[PageLoad] = []
    copies: list[PageCopy] = []
    saves: list[PageSave] = []
    grammars: dict[str, str] = {}
    grammar_drop: list[str] = []
    grammar_done: list[int] = []


class StepResult(msgspec.Struct, frozen=True):
    """Rank 0's answer to one step: the sampled token per sampling sequence.

    ``load_failures`` (rank -> why) is set when a ``PageLoad`` failed on some rank: then
    no rank ran the forward (they agreed before its first collective), ``tokens`` is
    empty and the scheduler recomputes what the step loaded (``Scheduler.update``)."""

    step: int
    tokens: dict[int, int]                 # seq_id -> sampled token (rank 0 only)
    logprobs: dict[int, TokenLogprobs] = {}
    load_failures: dict[int, str] = {}


_plan_encoder = msgspec.msgpack.Encoder()
_plan_decoder = msgspec.msgpack.Decoder(StepPlan)
_result_decoder = msgspec.msgpack.Decoder(StepResult)


def encode_plan(plan: StepPlan) -> bytes:
    return _plan_encoder.encode(plan)


def decode_plan(data: bytes) -> StepPlan:
    return _plan_decoder.decode(data)


def encode_result(result: StepResult) -> bytes:
    return _plan_encoder.encode(result)


def decode_result(data: bytes) -> StepResult:
    return _result_decoder.decode(data)
