"""Sampling: per-request parameters (vLLM's shape), the per-step spec and stop strings;
the draw itself is the rank's (``engine/worker/sampler.py``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .._errors import SamplingParamsError
from .grammar import Grammar
from .plan import SamplingSpec

__all__ = ["GREEDY_EPS", "SamplingParams", "StopChecker"]

GREEDY_EPS = 1e-5          # temperatures below this are greedy, as in vLLM
MAX_LOGPROBS = 20           # the top alternatives a request may ask for
# A step plan carries seed and top_k as msgpack integers (64 bits): a value outside
# these ranges would fail the plan's encoding, the engine's own step code (issue 45).
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)
TOP_K_MAX = (1 << 31) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops (the fields of vLLM's SamplingParams).

    ``temperature`` 0 is greedy. ``top_k`` -1 (or 0) keeps every token; ``top_p`` 1.0
    keeps the whole distribution. ``stop`` strings end the output before the string
    (excluded from the text, as vLLM does); ``stop_token_ids`` and EOS (unless
    ``ignore_eos``) end it after the token (kept in ``token_ids``, not in the text).
    ``logprobs`` k returns the chosen token's logprob and the top k alternatives.
    ``grammar`` (``core/grammar.py``'s ``compile_grammar``) constrains every token drawn
    to its language; its end is the model's EOS, which then ends the output even with
    ``ignore_eos``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    grammar: Grammar | None = None
    _stops: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def bad(name: str, value: object, why: str) -> SamplingParamsError:
            return SamplingParamsError(f"SamplingParams.{name}={value!r}: {why}")

        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise bad("temperature", self.temperature, "must be a finite number >= 0")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) \
                or not -1 <= self.top_k <= TOP_K_MAX:
            raise bad("top_k", self.top_k,
                      f"must be an int in [1, {TOP_K_MAX}], or -1 / 0 for no limit")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool)
            or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]
        ):
            raise bad("seed", self.seed, "must be None or an int in [-2**63, 2**63 - 1]")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
            or self.max_tokens < 1
        ):
            raise bad("max_tokens", self.max_tokens, "must be an int >= 1 or None")
        stops: tuple[str, ...]
        if self.stop is None:
            stops = ()
        elif isinstance(self.stop, str):
            stops = (self.stop,)
        else:
            stops = tuple(self.stop)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise bad("stop", self.stop, "stop strings must be non-empty strings")
        object.__setattr__(self, "_stops", stops)
        for t in self.stop_token_ids or []:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise bad("stop_token_ids", self.stop_token_ids, "must be token ids >= 0")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad("logprobs", self.logprobs, f"must be an int in [0, {MAX_LOGPROBS}] or None")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise bad("grammar", self.grammar, "must be a Grammar (compile_grammar) or None")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stops

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def spec(self, step_index: int) -> SamplingSpec:
        """The per-step spec for drawing output token ``step_index``."""
        return SamplingSpec(
            temperature=0.0 if self.greedy else float(self.temperature),
            top_p=float(self.top_p),
            top_k=-1 if self.top_k in (0, -1) else self.top_k,
            seed=self.seed,
            logprobs=self.logprobs,
            step_index=step_index,
            grammar=self.grammar.key if self.grammar is not None else None,
        )


class StopChecker:
    """Finds a stop string in a request's growing text, checking only the new part.

    ``check(text, new_from)`` returns the index where the kept text ends if a stop string
    appeared (at or after what could overlap ``new_from``), else None.
    """

    __slots__ = ("_include", "_longest", "_stops", "matched")

    def __init__(self, stops: Sequence[str], include_in_output: bool = False) -> None:
        self._stops = tuple(stops)
        self._longest = max((len(s) for s in self._stops), default=0)
        self._include = include_in_output
        self.matched: str | None = None

    def __bool__(self) -> bool:
        return bool(self._stops)

    def check(self, text: str, new_from: int) -> int | None:
        if not self._stops:
            return None
        lo = max(0, new_from - self._longest + 1)
        best: tuple[int, str] | None = None
        for s in self._stops:
            at = text.find(s, lo)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        self.matched = best[1]
        return best[0] + len(best[1]) if self._include else best[0]

    @property
    def holdback(self) -> int:
        """Characters at the end of a streamed text that may be the start of a stop string."""
        return max(0, self._longest - 1)
