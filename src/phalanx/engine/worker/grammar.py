"""The rank side of structured outputs: one llguidance matcher per constrained sequence,
on rank 0 (the rank that samples: the other ranks never see a token's draw, so at any
TP size the grammar lives in one place and every rank runs the same plan).

Each step: :meth:`Matchers.update` applies the plan's grammar table (texts to hold,
keys to forget, sequences that ended); :meth:`Matchers.allowed` computes the mask of
each sampling row under a grammar (the matcher is built from its grammar's text at the
sequence's first draw); the sampler draws among the allowed tokens; :meth:`advance`
feeds each matcher its sequence's token.

A matcher lives as long as its sequence, not its pages: a preempted sequence keeps its
matcher, and when it is recomputed and samples again, its spec's ``step_index`` (the
output tokens drawn so far) equals what the matcher consumed. A matcher that consumed
more (a step whose token the parent never kept) rolls back to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer

from .._errors import EngineError
from ..core.plan import SamplingSpec, StepPlan

__all__ = ["Matchers"]


class _Seq:
    __slots__ = ("consumed", "matcher")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.consumed = 0       # tokens fed to the matcher (output tokens 0..consumed-1)


class Matchers:
    """Rank 0's grammars (key -> text) and matchers (sequence id -> matcher)."""

    def __init__(self, tokenizer_json: str, vocab: int, eos_ids: Sequence[int]) -> None:
        self._vocab = vocab
        self._eos = [int(e) for e in eos_ids if 0 <= e < vocab]
        if not self._eos:
            raise EngineError("structured outputs need the model's end-of-sequence token "
                              "ids; this model declares none")
        self._tok = LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=self._eos)
        self._texts: dict[str, str] = {}
        self._seqs: dict[int, _Seq] = {}

    def update(self, plan: StepPlan) -> None:
        for key in plan.grammar_drop:
            self._texts.pop(key, None)
        self._texts.update(plan.grammars)
        for seq_id in plan.grammar_done:
            self._seqs.pop(seq_id, None)

    @property
    def live(self) -> int:
        """Matchers held (sequences under a grammar that have not ended)."""
        return len(self._seqs)

    def allowed(self, seqs: Sequence[int], specs: Sequence[SamplingSpec]
                ) -> dict[int, torch.Tensor]:
        """Row -> bool mask [vocab] of the tokens each constrained row may draw."""
        out: dict[int, torch.Tensor] = {}
        for row, (seq_id, spec) in enumerate(zip(seqs, specs, strict=True)):
            if spec.grammar is None:
                continue
            state = self._state(seq_id, spec)
            m = state.matcher
            bits = None if m.is_error() else np.frombuffer(m.compute_bitmask(), np.uint8)
            if bits is None or not bits.any():
                # a matcher in error (llguidance never raises) ends its sequence: only
                # EOS, so the parent sees a normal stop rather than a rank's failure
                mask = torch.zeros(self._vocab, dtype=torch.bool)
                mask[self._eos] = True
            else:
                mask = torch.from_numpy(
                    np.unpackbits(bits, bitorder="little")[: self._vocab].astype(bool))
            out[row] = mask
        return out

    def advance(self, seqs: Sequence[int], specs: Sequence[SamplingSpec],
                tokens: Sequence[int]) -> None:
        for seq_id, spec, tok in zip(seqs, specs, tokens, strict=True):
            if spec.grammar is None:
                continue
            state = self._seqs[seq_id]
            state.matcher.consume_token(int(tok))
            state.consumed += 1

    def _state(self, seq_id: int, spec: SamplingSpec) -> _Seq:
        state = self._seqs.get(seq_id)
        if state is None:
            assert spec.grammar is not None
            text = self._texts.get(spec.grammar)
            if text is None:
                raise EngineError(f"rank 0: sequence {seq_id} samples under grammar "
                                  f"{spec.grammar}, which no step plan sent (a bug of "
                                  f"the parent's grammar table)")
            state = self._seqs[seq_id] = _Seq(LLMatcher(self._tok, text, log_level=0))
        if state.consumed != spec.step_index:
            behind = state.consumed - spec.step_index
            if behind < 0 or not state.matcher.rollback(behind):
                raise EngineError(
                    f"rank 0: sequence {seq_id}'s matcher consumed {state.consumed} tokens "
                    f"but the step draws output token {spec.step_index}")
            state.consumed = spec.step_index
        return state
