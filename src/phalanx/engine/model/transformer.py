"""The decoder (Llama / Qwen2 / Mistral), sharded over the TP ranks.

Module names mirror the Hugging Face checkpoint (``model.layers.N.self_attn...``); one
table here maps the packed layers to the checkpoint tensors they hold (q/k/v in
``qkv_proj``, gate/up in ``gate_up_proj``). :class:`Shard` decides which heads and
MLP columns a rank holds:

- query heads and MLP columns split evenly (refused where they do not divide);
- KV heads split where ``num_key_value_heads % tp == 0``, otherwise replicated where
  ``tp % num_key_value_heads == 0`` (each rank holds the one KV head its query heads
  read, as vLLM does); any other combination is refused, naming both values;
- embedding and LM head replicated by default (``vocab_parallel=True`` splits them by
  vocabulary rows; see the design notes for the measurement behind the default).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .._errors import CheckpointError, ModelConfigError
from .attention import AttnMeta, paged_attention
from .checkpoint import open_checkpoint
from .config import ModelConfig
from .layers import LMHead, ParallelLinear, Part, RMSNorm, Rotary, VocabEmbedding
from .parallel import SoloComm, TPComm
from .weights import LoadReport, WeightSource

__all__ = ["CausalLM", "Shard", "torch_dtype"]


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[name]


@dataclass(frozen=True)
class Shard:
    """What rank ``rank`` of ``size`` holds of the attention heads and MLP."""

    rank: int
    size: int
    heads: int           # local query heads
    kv_start: int        # global index of the first local KV head
    kv_heads: int        # local KV heads
    inter: int           # local MLP columns

    @staticmethod
    def of(cfg: ModelConfig, rank: int, size: int) -> Shard:
        cfg.check_tp(size)
        heads = cfg.num_heads // size
        kvh = cfg.num_kv_heads
        if kvh % size == 0:
            kv_start, kv_local = rank * (kvh // size), kvh // size
        else:  # size % kvh == 0: check_tp refused the rest
            kv_start, kv_local = (rank * heads) // cfg.kv_groups, 1
        return Shard(rank, size, heads, kv_start, kv_local, cfg.intermediate_size // size)


class Attention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, sh: Shard, prefix: str, comm: TPComm,
                 rotary: Rotary, dtype: torch.dtype, layer: int = 0) -> None:
        super().__init__()
        self.layer, self.layers = layer, cfg.num_layers
        d = cfg.head_dim
        quantized = cfg.quantization == "gguf"
        self.heads, self.kv_heads, self.d = sh.heads, sh.kv_heads, d
        q0 = sh.rank * sh.heads * d
        k0 = sh.kv_start * d
        nq, nkv = cfg.num_heads * d, cfg.num_kv_heads * d
        self.qkv_proj = ParallelLinear(cfg.hidden_size, [
            Part(f"{prefix}.q_proj", q0, q0 + sh.heads * d, nq),
            Part(f"{prefix}.k_proj", k0, k0 + sh.kv_heads * d, nkv),
            Part(f"{prefix}.v_proj", k0, k0 + sh.kv_heads * d, nkv),
        ], 0, cfg.qkv_bias, dtype, quantized=quantized)
        self.o_proj = ParallelLinear(cfg.hidden_size, [
            Part(f"{prefix}.o_proj", q0, q0 + sh.heads * d, nq)], 1, cfg.o_bias, dtype,
            comm, quantized=quantized)
        self.rotary = rotary
        self.scale = d ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttnMeta,
                kv: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        nq, nk = self.heads * self.d, self.kv_heads * self.d
        q = qkv[:, :nq].view(t, self.heads, self.d)
        k = qkv[:, nq:nq + nk].view(t, self.kv_heads, self.d)
        v = qkv[:, nq + nk:].view(t, self.kv_heads, self.d)
        q, k = self.rotary(positions, q, k)
        o = paged_attention(q, k, v, kv, meta, self.scale, self.layer, self.layers)
        return self.o_proj(o.reshape(t, nq))  # type: ignore[no-any-return]


class MLP(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, sh: Shard, prefix: str, comm: TPComm,
                 dtype: torch.dtype) -> None:
        super().__init__()
        c0 = sh.rank * sh.inter
        self.inter = sh.inter
        full = cfg.intermediate_size
        quantized = cfg.quantization == "gguf"
        self.gate_up_proj = ParallelLinear(cfg.hidden_size, [
            Part(f"{prefix}.gate_proj", c0, c0 + sh.inter, full),
            Part(f"{prefix}.up_proj", c0, c0 + sh.inter, full)], 0, False, dtype,
            quantized=quantized)
        self.down_proj = ParallelLinear(cfg.hidden_size, [
            Part(f"{prefix}.down_proj", c0, c0 + sh.inter, full)], 1, False, dtype, comm,
            quantized=quantized)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        return self.down_proj(F.silu(gu[:, :self.inter]) * gu[:, self.inter:])  # type: ignore[no-any-return]


class DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, sh: Shard, i: int, comm: TPComm, rotary: Rotary,
                 dtype: torch.dtype) -> None:
        super().__init__()
        p = f"model.layers.{i}"
        eps, h = cfg.rms_norm_eps, cfg.hidden_size
        self.input_layernorm = RMSNorm(f"{p}.input_layernorm", h, eps, dtype)
        self.self_attn = Attention(cfg, sh, f"{p}.self_attn", comm, rotary, dtype, i)
        self.post_attention_layernorm = RMSNorm(f"{p}.post_attention_layernorm", h, eps, dtype)
        self.mlp = MLP(cfg, sh, f"{p}.mlp", comm, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttnMeta,
                kv: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, meta, kv)
        return x + self.mlp(self.post_attention_layernorm(x))  # type: ignore[no-any-return]


class CausalLM(torch.nn.Module):
    """This rank's shard of the decoder, loaded by :meth:`load`."""

    def __init__(self, cfg: ModelConfig, comm: TPComm | None = None,
                 vocab_parallel: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.comm: TPComm = comm or SoloComm()
        self.dtype = torch_dtype(cfg.dtype)
        self.shard = Shard.of(cfg, self.comm.rank, self.comm.size)
        if vocab_parallel and cfg.vocab_size % self.comm.size:
            raise ModelConfigError(f"vocab_size={cfg.vocab_size} does not divide by the TP "
                                   f"size {self.comm.size}: use a replicated vocabulary")
        self.rotary = rotary = Rotary(cfg, self.dtype)
        self.embed_tokens = VocabEmbedding("model.embed_tokens", cfg.vocab_size,
                                           cfg.hidden_size, self.dtype, self.comm,
                                           vocab_parallel,
                                           quantized=cfg.quantization == "gguf")
        self.layers = torch.nn.ModuleList(
            DecoderLayer(cfg, self.shard, i, self.comm, rotary, self.dtype)
            for i in range(cfg.num_layers))
        self.norm = RMSNorm("model.norm", cfg.hidden_size, cfg.rms_norm_eps, self.dtype)
        self.lm_head = LMHead(self.embed_tokens,
                              None if cfg.tie_word_embeddings else "lm_head")

    @staticmethod
    def from_pretrained(model_dir: str | Path, cfg: ModelConfig, comm: TPComm | None = None,
                        vocab_parallel: bool = False) -> tuple[CausalLM, LoadReport]:
        """Build this rank's shard and read only its slices of the checkpoint."""
        model = CausalLM(cfg, comm, vocab_parallel)
        ckpt = open_checkpoint(model_dir)
        try:
            report = model.load(ckpt)
        finally:
            ckpt.close()
        return model, report

    def load(self, ckpt: WeightSource) -> LoadReport:
        for module in self.modules():
            load = getattr(module, "load", None)
            if load is not None and module is not self:
                load(ckpt)
        report = ckpt.report()
        if report.missing:

            raise CheckpointError(f"{ckpt.dir}: the checkpoint lacks {len(report.missing)} "
                                  f"tensors the model needs: {report.missing[:8]}")
        return report

    def weight_bytes(self) -> int:
        """Bytes of the weights this rank holds, quantized ones as held (tied weights
        counted once; the rotary tables are not weights)."""
        seen = {t.data_ptr(): t.numel() * t.element_size() for t in self.state_dict().values()
                if t.numel()}
        return sum(seen.values())

    def kv_shape(self, num_pages: int, page_tokens: int) -> tuple[int, ...]:
        """One layer's KV pool on this rank: [pages, 2 (K, V), page_tokens, kv_heads, d]."""
        return (num_pages, 2, page_tokens, self.shard.kv_heads, self.cfg.head_dim)

    def allocate_kv(self, num_pages: int, page_tokens: int,
                    device: torch.device | str = "cpu") -> list[torch.Tensor]:
        shape = self.kv_shape(num_pages, page_tokens)
        return [torch.zeros(shape, dtype=self.dtype, device=device)
                for _ in range(self.cfg.num_layers)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta,
                kv: list[torch.Tensor]) -> torch.Tensor:
        """Hidden states [T, hidden] (after the final norm) of the step's tokens."""
        self.rotary.ensure(int(positions.max()) + 1)
        x = self.embed_tokens(input_ids)
        for layer, pool in zip(self.layers, kv, strict=True):
            x = layer(x, positions, meta, pool)
        return self.norm(x)  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] in float32 (every rank gets all of them)."""
        return self.lm_head(hidden).float()  # type: ignore[no-any-return]
