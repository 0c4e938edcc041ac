"""Rotary position embeddings: the inverse frequencies of every ``rope_type`` the engine
honours, and the cos/sin tables a layer kind rotates with.

The frequencies follow transformers' ``modeling_rope_utils`` (the oracle the tests compare
with) field by field: ``linear`` divides positions by ``factor``; ``llama3`` rescales the
low frequencies; ``yarn`` blends interpolated and extrapolated frequencies over a ramp
between ``beta_fast`` and ``beta_slow`` rotations and scales cos/sin by its attention
factor; ``longrope`` (Phi-3) divides each frequency by its own factor, ``short_factor``
below ``original_max_position_embeddings`` and ``long_factor`` from there on, and scales
cos/sin too. transformers picks longrope's factors by the whole sequence's length (a
prompt that crosses the bound is rotated with the long factors throughout, and its cached
keys keep the short ones); here a position's own index picks them, as the paged KV
cannot rewrite keys already cached (docs/design.md, "Issue 44: architectures").

Hand-written: these are a few lines of arithmetic each, and transformers (which has
them) is not a runtime dependency of the ranks.
"""

from __future__ import annotations

import math

import torch

from .config import RopeScaling

__all__ = ["RopeScaling", "Rotary", "rope_inv_freq"]


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(theta: float, dim: int, s: RopeScaling | None,
                  freq_factors: tuple[float, ...] | None = None,
                  max_position_embeddings: int = 0, long: bool = False
                  ) -> tuple[torch.Tensor, float]:
    """The rotary inverse frequencies of a ``dim``-wide rotation (float32) and the factor
    cos/sin are scaled by. ``long``: longrope's long factors."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if freq_factors is not None:   # Llama 3.x as GGUF stores it
        return inv / torch.tensor(freq_factors, dtype=torch.float32), 1.0
    if s is None:
        return inv, 1.0
    if s.rope_type == "linear":
        return inv / s.factor, 1.0
    if s.rope_type == "llama3":
        # low frequencies slowed by `factor`, high ones kept, a smooth blend between
        old = s.original_max_position_embeddings
        low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    old = s.original_max_position_embeddings
    if s.rope_type == "longrope":
        factor = s.factor if s.factor != 1.0 else max_position_embeddings / old
        attn = s.attention_factor
        if attn is None:
            attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))
        ext = torch.tensor(s.long_factor if long else s.short_factor, dtype=torch.float32)
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (ext * theta ** shape), attn
    # yarn
    attn = s.attention_factor if s.attention_factor is not None else _yarn_mscale(s.factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return inv / s.factor * (1 - extrapolation) + inv * extrapolation, attn


class Rotary(torch.nn.Module):
    """Rotary position embedding (the rotate-half form Hugging Face checkpoints use) over
    the first ``rotary_dim`` dims of each head, with cos/sin tabled for every position up
    to ``max_model_len``. One per kind of layer (Gemma 3's sliding and global layers
    rotate with different bases)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, theta: float, scaling: RopeScaling | None, rotary_dim: int,
                 max_model_len: int, dtype: torch.dtype, max_position_embeddings: int = 0,
                 freq_factors: tuple[float, ...] | None = None) -> None:
        super().__init__()
        self.dim = rotary_dim
        long = scaling is not None and scaling.rope_type == "longrope" and \
            max_model_len > scaling.original_max_position_embeddings
        self.inv_freq, self.attn = rope_inv_freq(theta, rotary_dim, scaling, freq_factors,
                                                 max_position_embeddings, long)
        self.dtype = dtype
        self.limit = max_model_len
        # buffers, so that moving the model to a device moves the tables with it
        self.register_buffer("cos", torch.empty(0, rotary_dim, dtype=dtype), persistent=False)
        self.register_buffer("sin", torch.empty(0, rotary_dim, dtype=dtype), persistent=False)
        self.ensure(min(self.limit, 4096))

    def ensure(self, positions: int) -> None:
        """Table at least ``positions`` positions. Tables grow by doubling up to
        ``max_model_len``: a 128k-context config does not cost 128k rows until it is used.
        A row's values do not depend on the table's length."""
        have = self.cos.shape[0]
        if positions <= have:
            return
        n = min(self.limit, max(positions, 2 * have))
        pos = torch.arange(n, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * self.attn).to(device=self.cos.device, dtype=self.dtype)
        self.sin = (emb.sin() * self.attn).to(device=self.sin.device, dtype=self.dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` [T, heads, d], ``k`` [T, kv_heads, d] rotated to ``positions`` [T]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        if self.dim == q.shape[-1]:
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        r = self.dim   # partial rotary (Phi-4-mini): the rest of each head passes through
        qr, kr = q[..., :r], k[..., :r]
        return (torch.cat((qr * cos + _rotate_half(qr) * sin, q[..., r:]), -1),
                torch.cat((kr * cos + _rotate_half(kr) * sin, k[..., r:]), -1))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
