"""A mixture-of-experts block (Qwen3-MoE, Mixtral), its experts split over the TP ranks by
their intermediate dimension.

Every rank holds the router whole and, of every expert, the same share of its columns
(``moe_intermediate_size / tp``: gate and up rows, down columns), as the dense MLP is
split. So each rank computes its part of every chosen expert for every token, and one
all-reduce per layer sums the ranks' parts, as for a dense MLP: no token moves between
ranks, and the load is even whatever the router picks. (Expert parallelism, whole
experts per rank, would need an all-to-all and balanced routing; at CPU batch sizes the
per-layer all-reduce is the cheaper collective.) Quantized expert weights stay in their
GGUF blocks through :class:`~phalanx.engine.model.layers.ParallelLinear`, as dense ones.

Routing follows transformers: softmax over every expert in float32, the top
``experts_per_tok``, renormalised to sum to 1 where the config says so (Mixtral always,
Qwen3-MoE with ``norm_topk_prob``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .layers import ParallelLinear, Part

if TYPE_CHECKING:
    from .config import ModelConfig
    from .parallel import TPComm
    from .transformer import Shard

__all__ = ["SparseMoE", "moe_prefix"]

# layout -> (block name under the layer, expert's gate, up, down names)
_NAMES = {"qwen": ("mlp", "gate_proj", "up_proj", "down_proj"),
          "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}


def moe_prefix(cfg: ModelConfig, layer: str) -> str:
    """The checkpoint prefix of layer ``layer``'s expert block."""
    return f"{layer}.{_NAMES[cfg.moe_layout][0]}"


class Expert(torch.nn.Module):
    """This rank's columns of one expert's gated MLP; its down projection's partial sum is
    left for the block's one all-reduce."""

    def __init__(self, cfg: ModelConfig, sh: Shard, prefix: str, dtype: torch.dtype) -> None:
        super().__init__()
        _, gate, up, down = _NAMES[cfg.moe_layout]
        full = cfg.moe_intermediate_size
        self.inter = local = full // sh.size
        c0 = sh.rank * local
        quantized = cfg.quantization == "gguf"
        self.gate_up_proj = ParallelLinear(cfg.hidden_size, [
            Part(f"{prefix}.{gate}", c0, c0 + local, full),
            Part(f"{prefix}.{up}", c0, c0 + local, full)], 0, False, dtype,
            quantized=quantized)
        self.down_proj = ParallelLinear(cfg.hidden_size, [
            Part(f"{prefix}.{down}", c0, c0 + local, full)], 1, False, dtype, None,
            quantized=quantized)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        return self.down_proj(F.silu(gu[:, :self.inter]) * gu[:, self.inter:])  # type: ignore[no-any-return]


class SparseMoE(torch.nn.Module):
    """Router top-k over ``num_experts`` experts, each split by columns over the ranks."""

    def __init__(self, cfg: ModelConfig, sh: Shard, prefix: str, comm: TPComm,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.comm = comm
        self.top_k = cfg.experts_per_tok
        self.norm = cfg.norm_topk_prob
        e = cfg.num_experts
        # the router stays dense: E x hidden is small, and its scores decide everything
        self.gate = ParallelLinear(cfg.hidden_size, [Part(f"{prefix}.gate", 0, e, e)], 0,
                                   False, dtype)
        self.experts = torch.nn.ModuleList(Expert(cfg, sh, f"{prefix}.experts.{i}", dtype)
                                           for i in range(e))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)    # [T, k]
        if self.norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            y = self.experts[e](x[rows])
            out.index_add_(0, rows, y * weights[rows, slot].unsqueeze(-1))
        if self.comm.size > 1:
            out = self.comm.all_reduce(out)
        return out
