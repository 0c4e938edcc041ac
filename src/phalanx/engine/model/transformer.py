"""The decoder (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, Gemma 2 and 3, Phi-3),
sharded over the TP ranks. One decoder: each family's differences are the config's
flags (config.py's Family table; docs/design.md, "Issue 44: architectures").

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
from .layers import LMHead, ParallelLinear, Part, RMSNorm, VocabEmbedding
from .moe import SparseMoE, moe_prefix
from .parallel import SoloComm, TPComm
from .rope import Rotary
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
        if cfg.fused_qkv:   # Phi-3: q, k and v rows of one tensor
            fused, total = f"{prefix}.qkv_proj", nq + 2 * nkv
            parts = [Part(fused, q0, q0 + sh.heads * d, total),
                     Part(fused, nq + k0, nq + k0 + sh.kv_heads * d, total),
                     Part(fused, nq + nkv + k0, nq + nkv + k0 + sh.kv_heads * d, total)]
        else:
            parts = [Part(f"{prefix}.q_proj", q0, q0 + sh.heads * d, nq),
                     Part(f"{prefix}.k_proj", k0, k0 + sh.kv_heads * d, nkv),
                     Part(f"{prefix}.v_proj", k0, k0 + sh.kv_heads * d, nkv)]
        self.qkv_proj = ParallelLinear(cfg.hidden_size, parts, 0, cfg.qkv_bias, dtype,
                                       quantized=quantized)
        self.o_proj = ParallelLinear(cfg.hidden_size, [
            Part(f"{prefix}.o_proj", q0, q0 + sh.heads * d, nq)], 1, cfg.o_bias, dtype,
            comm, quantized=quantized)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:   # over each head's d features, before rotary
            self.q_norm = RMSNorm(f"{prefix}.q_norm", d, cfg.rms_norm_eps, dtype,
                                  cfg.norm_offset)
            self.k_norm = RMSNorm(f"{prefix}.k_norm", d, cfg.rms_norm_eps, dtype,
                                  cfg.norm_offset)
        self.rotary = rotary
        self.scale = cfg.attn_scale or d ** -0.5
        self.softcap = cfg.attn_softcap
        self.window = (cfg.sliding_window or 0) if cfg.is_sliding(layer) else 0

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttnMeta,
                kv: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        nq, nk = self.heads * self.d, self.kv_heads * self.d
        q = qkv[:, :nq].view(t, self.heads, self.d)
        k = qkv[:, nq:nq + nk].view(t, self.kv_heads, self.d)
        v = qkv[:, nq + nk:].view(t, self.kv_heads, self.d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        o = paged_attention(q, k, v, kv, meta, self.scale, self.layer, self.layers,
                            self.window, self.softcap)
        return self.o_proj(o.reshape(t, nq))  # type: ignore[no-any-return]


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class MLP(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, sh: Shard, prefix: str, comm: TPComm,
                 dtype: torch.dtype) -> None:
        super().__init__()
        c0 = sh.rank * sh.inter
        self.inter = sh.inter
        full = cfg.intermediate_size
        quantized = cfg.quantization == "gguf"
        if cfg.fused_qkv:   # Phi-3: gate rows then up rows of one tensor
            fused = f"{prefix}.gate_up_proj"
            parts = [Part(fused, c0, c0 + sh.inter, 2 * full),
                     Part(fused, full + c0, full + c0 + sh.inter, 2 * full)]
        else:
            parts = [Part(f"{prefix}.gate_proj", c0, c0 + sh.inter, full),
                     Part(f"{prefix}.up_proj", c0, c0 + sh.inter, full)]
        self.gate_up_proj = ParallelLinear(cfg.hidden_size, parts, 0, False, dtype,
                                           quantized=quantized)
        self.down_proj = ParallelLinear(cfg.hidden_size, [
            Part(f"{prefix}.down_proj", c0, c0 + sh.inter, full)], 1, False, dtype, comm,
            quantized=quantized)
        self.act = _gelu_tanh if cfg.activation == "gelu_tanh" else F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        return self.down_proj(self.act(gu[:, :self.inter]) * gu[:, self.inter:])  # type: ignore[no-any-return]


class DecoderLayer(torch.nn.Module):
    """Pre-norm residual blocks; with ``sandwich_norms`` (Gemma) each block's output is
    normed too before the residual add, and the MLP's input norm has its own name."""

    def __init__(self, cfg: ModelConfig, sh: Shard, i: int, comm: TPComm, rotary: Rotary,
                 dtype: torch.dtype) -> None:
        super().__init__()
        p = f"model.layers.{i}"
        eps, h, off = cfg.rms_norm_eps, cfg.hidden_size, cfg.norm_offset

        def norm(name: str) -> RMSNorm:
            return RMSNorm(f"{p}.{name}", h, eps, dtype, off)

        self.input_layernorm = norm("input_layernorm")
        self.self_attn = Attention(cfg, sh, f"{p}.self_attn", comm, rotary, dtype, i)
        self.post_attn_norm: RMSNorm | None = None
        self.post_mlp_norm: RMSNorm | None = None
        if cfg.sandwich_norms:
            self.post_attn_norm = norm("post_attention_layernorm")
            self.pre_mlp_norm = norm("pre_feedforward_layernorm")
            self.post_mlp_norm = norm("post_feedforward_layernorm")
        else:
            self.pre_mlp_norm = norm("post_attention_layernorm")
        self.mlp: torch.nn.Module = (SparseMoE(cfg, sh, moe_prefix(cfg, p), comm, dtype)
                                     if cfg.is_moe(i) else MLP(cfg, sh, f"{p}.mlp", comm, dtype))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttnMeta,
                kv: torch.Tensor) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(x), positions, meta, kv)
        x = x + (a if self.post_attn_norm is None else self.post_attn_norm(a))
        m = self.mlp(self.pre_mlp_norm(x))
        return x + (m if self.post_mlp_norm is None else self.post_mlp_norm(m))  # type: ignore[no-any-return]


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
        dim = cfg.rotary_dim or cfg.head_dim
        self.rotary = Rotary(cfg.rope_theta, cfg.rope_scaling, dim, cfg.max_model_len,
                             self.dtype, cfg.max_position_embeddings, cfg.rope_freq_factors)
        # sliding layers with their own base (Gemma 3) rotate with a table of their own
        self.local_rotary = self.rotary if cfg.local_rope_theta is None else Rotary(
            cfg.local_rope_theta, cfg.local_rope_scaling, dim, cfg.max_model_len,
            self.dtype, cfg.max_position_embeddings)
        self.embed_tokens = VocabEmbedding("model.embed_tokens", cfg.vocab_size,
                                           cfg.hidden_size, self.dtype, self.comm,
                                           vocab_parallel,
                                           quantized=cfg.quantization == "gguf")
        self.layers = torch.nn.ModuleList(
            DecoderLayer(cfg, self.shard, i, self.comm,
                         self.local_rotary if cfg.is_sliding(i) else self.rotary, self.dtype)
            for i in range(cfg.num_layers))
        self.norm = RMSNorm("model.norm", cfg.hidden_size, cfg.rms_norm_eps, self.dtype,
                            cfg.norm_offset)
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
        top = int(positions.max()) + 1
        self.rotary.ensure(top)
        self.local_rotary.ensure(top)
        x = self.embed_tokens(input_ids)
        if self.cfg.embed_scale != 1.0:   # Gemma: the scale rounded to the weights' dtype
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        for layer, pool in zip(self.layers, kv, strict=True):
            x = layer(x, positions, meta, pool)
        return self.norm(x)  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] in float32 (every rank gets all of them)."""
        logits = self.lm_head(hidden).float()
        cap = self.cfg.final_softcap
        if cap is not None:   # Gemma 2
            logits = torch.tanh(logits / cap) * cap
        return logits  # type: ignore[no-any-return]
