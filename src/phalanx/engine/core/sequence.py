"""A request as the scheduler sees it: its tokens, its pages, its progress and its end.

Pure state, no torch. The scheduler moves a sequence between statuses; the engine loop
appends sampled tokens and decides when it finishes.
"""

from __future__ import annotations

import enum
from itertools import count

from .sampling import SamplingParams

__all__ = ["FinishReason", "Seq", "SeqStatus"]


class SeqStatus(enum.Enum):
    # Admitted but holding no pages: new, or preempted (its pages were freed and its
    # computed KV is recomputed, with its output so far, when it runs again).
    WAITING = "waiting"
    # Holding pages and scheduled at each step (prefill chunks, then one decode token).
    RUNNING = "running"
    # Done; its pages are released (full pages stay in the cache as free, reusable pages).
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"          # EOS, a stop token id or a stop string
    LENGTH = "length"      # max_tokens, or the model's context
    ABORT = "abort"        # cancelled by the caller
    ERROR = "error"        # the engine failed (a rank died); see the request's error


_ids = count()


class Seq:
    """One request: prompt + output tokens, block table, computed count, end state.

    ``num_computed`` counts tokens whose KV is in this sequence's pages (loaded from
    memory/disk or computed); ``all_tokens[num_computed:]`` still need a forward.
    ``cached_memory`` / ``cached_disk`` count prompt tokens served from each tier at the
    first admission (vLLM's ``num_cached_tokens`` is their sum).
    """

    __slots__ = (
        "_first_admit",
        "block_table",
        "cached_disk",
        "cached_memory",
        "cancelled",
        "finish_reason",
        "key_chain",
        "num_computed",
        "num_preemptions",
        "num_registered",
        "output_tokens",
        "params",
        "prompt_tokens",
        "seq_id",
        "status",
        "stop_reason",
    )

    def __init__(
        self, prompt_tokens: list[int], params: SamplingParams, seq_id: int | None = None,
    ) -> None:
        self.seq_id = next(_ids) if seq_id is None else seq_id
        self.prompt_tokens = list(prompt_tokens)
        self.output_tokens: list[int] = []
        self.params = params
        self.status = SeqStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed = 0
        self.key_chain: list[bytes] = []   # keys of this sequence's full pages, in order
        self.num_registered = 0            # leading pages whose key the pool holds
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.cached_memory = 0
        self.cached_disk = 0
        self.num_preemptions = 0
        self.cancelled = False
        self._first_admit = True

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt_tokens + self.output_tokens

    def __len__(self) -> int:
        return len(self.prompt_tokens) + len(self.output_tokens)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_tokens)

    @property
    def num_output(self) -> int:
        return len(self.output_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def cached_tokens(self) -> int:
        return self.cached_memory + self.cached_disk

    def token_at(self, i: int) -> int:
        p = len(self.prompt_tokens)
        return self.prompt_tokens[i] if i < p else self.output_tokens[i - p]

    def tokens_range(self, lo: int, hi: int) -> list[int]:
        p = len(self.prompt_tokens)
        if hi <= p:
            return self.prompt_tokens[lo:hi]
        if lo >= p:
            return self.output_tokens[lo - p : hi - p]
        return self.prompt_tokens[lo:] + self.output_tokens[: hi - p]

    def take_first_admit(self) -> bool:
        """True once: at the first admission (cached-token counters are set then)."""
        first, self._first_admit = self._first_admit, False
        return first

    def __repr__(self) -> str:
        return (f"Seq(id={self.seq_id}, {self.status.value}, prompt={self.num_prompt}, "
                f"out={self.num_output}, computed={self.num_computed}, "
                f"pages={self.block_table})")
