"""What a request returns, in vLLM's shape, and the incremental detokenizer behind its text.

The engine reports deltas, never histories (issue 43): each step gives one
:class:`StepDelta` per request it advanced -- the new token ids, the text they
completed, their logprobs -- and nothing it reported before. A server streams them as
they are. :class:`OutputBuilder` keeps a request's history for the Python API, where
``RequestOutput.outputs[0]`` is a :class:`CompletionOutput` (``token_ids``, ``text``,
``finish_reason``, ``logprobs``...), cumulative as vLLM's, with what the step added
(``delta_text``, ``delta_token_ids``). ``num_cached_tokens`` is vLLM's count of prompt
tokens whose KV was not computed; phalanx splits it by tier (``cached_tokens_memory``,
``cached_tokens_disk``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["CompletionOutput", "IncrementalDetokenizer", "Logprob", "OutputBuilder",
           "RequestOutput", "StepDelta"]

# Prompt tokens the detokenizer decodes before the first output token, as vLLM does: some
# decoders (SentencePiece's leading space) render a token differently at the start.
_CONTEXT_TOKENS = 5


@dataclass(frozen=True)
class Logprob:
    """One candidate token's logprob, its rank among the candidates (1 = best)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None     # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    cached_tokens_memory: int = 0
    cached_tokens_disk: int = 0
    error: BaseException | None = None   # set when finish_reason is "error"


@dataclass(frozen=True)
class StepDelta:
    """What one step added to one request: the engine's only output.

    ``logprobs`` has one entry per new token (None when the request asked for none).
    The counts are the request's totals so far; ``finish_reason`` is set on its last."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, Logprob]] | None
    num_prompt_tokens: int
    num_output_tokens: int
    cached_tokens_memory: int
    cached_tokens_disk: int
    finish_reason: str | None = None     # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None
    error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputBuilder:
    """One request's history, built from its deltas, for the Python API."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 logprobs: bool) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if logprobs else None
        self.cumulative_logprob: float | None = 0.0 if logprobs else None
        self.last: StepDelta | None = None

    def add(self, delta: StepDelta) -> None:
        self.token_ids += delta.token_ids
        self.text += delta.text
        if self.logprobs is not None and delta.logprobs is not None:
            self.logprobs += delta.logprobs
            for tok, entry in zip(delta.token_ids, delta.logprobs, strict=True):
                self.cumulative_logprob = (self.cumulative_logprob or 0.0) + \
                    entry[tok].logprob
        self.last = delta

    def output(self) -> RequestOutput:
        """The request as it stands: cumulative, with the last step's delta."""
        d = self.last
        assert d is not None, "no delta yet"
        comp = CompletionOutput(
            index=0, text=self.text, token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=d.finish_reason, stop_reason=d.stop_reason,
            delta_text=d.text, delta_token_ids=list(d.token_ids))
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids), outputs=[comp],
            finished=d.finished,
            num_cached_tokens=d.cached_tokens_memory + d.cached_tokens_disk,
            cached_tokens_memory=d.cached_tokens_memory,
            cached_tokens_disk=d.cached_tokens_disk, error=d.error)


class IncrementalDetokenizer:
    """Text of a growing token list, decoding only a short window at each token.

    ``decode(ids)`` must render a token list (special tokens skipped as configured). A
    token that ends inside a multi-byte character renders U+FFFD; its text is held back
    until the character completes.
    """

    __slots__ = ("_decode", "_prefix", "_read", "_tokens", "text")

    def __init__(self, decode: Callable[[list[int]], str], prompt: Sequence[int] = ()) -> None:
        self._decode = decode
        self._tokens = list(prompt[-_CONTEXT_TOKENS:]) if prompt else []
        self._prefix = 0
        self._read = len(self._tokens)
        self.text = ""

    def push(self, token: int) -> str:
        """Add ``token``; returns the text it completed (may be empty)."""
        self._tokens.append(token)
        before = self._decode(self._tokens[self._prefix : self._read])
        after = self._decode(self._tokens[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            delta = after[len(before) :]
            self._prefix = self._read
            self._read = len(self._tokens)
            self.text += delta
            return delta
        return ""
