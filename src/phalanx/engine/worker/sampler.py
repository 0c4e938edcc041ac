"""The rank side of sampling: the next token of each row under its spec.

Determinism: a seeded request draws its token at output index ``i`` from a generator
seeded by ``(seed, i)`` alone, on a noise vector over the whole vocabulary, so the
same seed gives the same tokens whatever else is in the batch and whichever step the
token falls on (a preempted and recomputed request draws the same tokens again).
Sampling is the exponential race (argmax of ``p / E`` with ``E ~ Exp(1)``), which is an
exact draw from ``p`` and needs one noise vector per row, no cumulative sums.

Logprobs are those of the model's distribution (log-softmax of the raw logits, before
temperature and filtering), as vLLM returns by default.

``allowed`` (a structured output's grammar mask, ``worker/grammar.py``) removes the
tokens a row may not draw before temperature, top-k and top-p: the draw is from the
model's distribution restricted to the grammar; logprobs stay the model's own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

from .._errors import SamplingParamsError
from ..core.plan import SamplingSpec, TokenLogprobs
from ..core.sampling import GREEDY_EPS

__all__ = ["sample"]


def _row_seed(seed: int, step_index: int) -> int:
    # A stable digest, not Python's salted hash: the same (seed, index) on any machine.
    raw = hashlib.blake2b(f"{seed}:{step_index}".encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") & ((1 << 63) - 1)


def _filtered_probs(row: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    scaled = row / spec.temperature
    vocab = scaled.shape[-1]
    if spec.top_k > 0 and spec.top_k < vocab:
        kth = torch.topk(scaled, spec.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if spec.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = before >= spec.top_p     # the best token always stays (before = 0)
        drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    return probs


def sample(
    logits: torch.Tensor, specs: Sequence[SamplingSpec],
    generator: torch.Generator | None = None,
    allowed: Mapping[int, torch.Tensor] | None = None,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """The next token of each row of ``logits`` ``[rows, vocab]`` under its spec.

    ``generator`` draws for unseeded rows (None: torch's default generator).
    ``allowed``: row -> bool mask [vocab] of the tokens that row may draw. Returns
    the tokens and, per row, its logprobs (None where the spec asks for none).
    """
    if logits.dim() != 2 or logits.shape[0] != len(specs):
        raise SamplingParamsError(
            f"sample: logits of shape {tuple(logits.shape)} for {len(specs)} specs"
        )
    lf = logits.float()
    drawn = lf
    if allowed:
        drawn = lf.clone()
        for r, ok in allowed.items():
            drawn[r].masked_fill_(~ok.to(drawn.device), float("-inf"))
    if all(s.temperature < GREEDY_EPS and s.logprobs is None for s in specs):
        # a greedy batch: one argmax and one host transfer, not one .item() per row
        return [int(t) for t in torch.argmax(drawn, dim=-1).tolist()], [None] * len(specs)
    # the draws and logprobs read many single values: on the host, after one transfer from
    # a GPU (not one per value), and a seed draws the same tokens whatever the device
    lf, drawn = lf.cpu(), drawn.cpu()
    tokens: list[int] = []
    out_lp: list[TokenLogprobs | None] = []
    logsm: torch.Tensor | None = None
    for i, spec in enumerate(specs):
        row = drawn[i]
        if spec.temperature < GREEDY_EPS:
            tok = int(torch.argmax(row).item())
        else:
            probs = _filtered_probs(row, spec)
            if spec.seed is not None:
                g = torch.Generator(device=row.device)
                g.manual_seed(_row_seed(spec.seed, spec.step_index))
                noise = torch.empty_like(probs).exponential_(generator=g)
            else:
                noise = torch.empty_like(probs).exponential_(generator=generator)
            tok = int(torch.argmax(probs / noise).item())
        tokens.append(tok)
        if spec.logprobs is None:
            out_lp.append(None)
            continue
        if logsm is None:
            logsm = torch.log_softmax(lf, dim=-1)
        lrow = logsm[i]
        top: list[tuple[int, float]] = []
        if spec.logprobs > 0:
            vals, idx = torch.topk(lrow, min(spec.logprobs, lrow.shape[-1]))
            top = [(int(t), float(v)) for t, v in zip(idx.tolist(), vals.tolist(), strict=True)]
        out_lp.append(TokenLogprobs(token=tok, logprob=float(lrow[tok].item()), top=top))
    return tokens, out_lp
