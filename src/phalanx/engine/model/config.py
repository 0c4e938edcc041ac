"""A model's config, read from its Hugging Face ``config.json`` field by field.

Every field the decoder depends on is read explicitly; a value the engine cannot honour
(an unknown architecture or rope type, a sliding window shorter than the context, an
activation other than SiLU, biases on the MLP) is refused here with a
:class:`ModelConfigError` naming the field and the value, never turned into a silently
wrong answer later. Both spellings of the rope fields are read: ``rope_theta`` +
``rope_scaling`` (transformers 4.x) and ``rope_parameters`` (5.x).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .._errors import ModelConfigError
from .gguf_file import is_gguf, open_gguf
from .gguf_model import gguf_config, rope_freq_factors

__all__ = ["ARCHITECTURES", "DTYPES", "ModelConfig", "RopeScaling", "load_config",
           "local_kv_heads"]


@dataclass(frozen=True)
class Family:
    """What an architecture's checkpoints mean beyond the shared fields: each difference
    from Llama is a flag the decoder reads (docs/design.md, "Issue 44: architectures")."""

    qkv_bias: bool = False      # q/k/v biases unless attention_bias says otherwise
    window: bool = False        # sliding_window applies to every layer when set
    qwen_window: bool = False   # ... only with use_sliding_window, from max_window_layers
    qk_norm: bool = False       # per-head RMSNorm of q and k before rotary (Qwen3, Gemma 3)
    gemma: bool = False         # (1+w) norms, sqrt(hidden)-scaled embedding, sandwich norms
    fused: bool = False         # Phi-3: one qkv_proj and one gate_up_proj tensor
    moe: str = ""               # the experts' checkpoint layout: "qwen" or "mixtral"


# the Hugging Face class -> its family
ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(window=True),
    "Qwen2ForCausalLM": Family(qkv_bias=True, qwen_window=True),
    "Qwen3ForCausalLM": Family(qk_norm=True, qwen_window=True),
    "Qwen3MoeForCausalLM": Family(qk_norm=True, qwen_window=True, moe="qwen"),
    "MixtralForCausalLM": Family(window=True, moe="mixtral"),
    "Gemma2ForCausalLM": Family(gemma=True),
    "Gemma3ForCausalLM": Family(gemma=True, qk_norm=True),
    "Phi3ForCausalLM": Family(window=True, fused=True),
}
DTYPES = ("float32", "bfloat16", "float16")
_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class RopeScaling:
    """``rope_scaling`` / ``rope_parameters`` beyond the default (engine/model/rope.py
    computes the frequencies)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    # yarn and longrope: the cos/sin scale (None: derived from the factor)
    attention_factor: float | None = None
    # longrope: one divisor per rotary frequency
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    """What the decoder needs to know about a checkpoint, validated."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    max_model_len: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # "gguf": a GGUF file's Q4_0/Q4_1/Q8_0 weights stay quantized (engine/model/quant.py)
    quantization: str = "none"
    # Llama 3.x rope as GGUF stores it: one divisor per rotary frequency
    rope_freq_factors: tuple[float, ...] | None = None
    # -- per-family flags (the Family table; docs/design.md, "Issue 44: architectures") --
    qk_norm: bool = False             # per-head RMSNorm of q and k (Qwen3, Gemma 3)
    norm_offset: float = 0.0          # RMSNorm scales by (offset + w): Gemma's 1
    sandwich_norms: bool = False      # norms before and after attention and MLP (Gemma)
    embed_scale: float = 1.0          # the embedding times this (Gemma: sqrt(hidden))
    activation: str = "silu"          # the gated MLP's: silu | gelu_tanh
    fused_qkv: bool = False           # Phi-3's qkv_proj / gate_up_proj tensors
    attn_scale: float | None = None   # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    attn_softcap: float | None = None   # scores: cap * tanh(s / cap) (Gemma 2)
    final_softcap: float | None = None  # logits likewise
    rotary_dim: int = 0               # dims of a head rotated (0: all; Phi-4-mini: 3/4)
    # sliding-window layers: layer i attends over its last `sliding_window` positions
    # where layer_sliding[i]; they rotate with local_rope_theta / local_rope_scaling
    sliding_window: int | None = None
    layer_sliding: tuple[bool, ...] = ()
    local_rope_theta: float | None = None
    local_rope_scaling: RopeScaling | None = None
    # mixture of experts: layer i routes each token to experts_per_tok of num_experts
    # experts (of moe_intermediate_size columns) where layer_moe[i]
    moe_layout: str = ""
    num_experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    layer_moe: tuple[bool, ...] = ()

    @property
    def kv_groups(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_sliding) and self.layer_sliding[layer]

    def is_moe(self, layer: int) -> bool:
        return bool(self.layer_moe) and self.layer_moe[layer]

    def tp_problem(self, size: int) -> str | None:
        """Why TP ``size`` cannot split this model (None: it can). Query heads and MLP
        columns split evenly; KV heads split, or are replicated when TP is a multiple of
        them (engine/model/transformer.py's Shard)."""
        if self.num_heads % size:
            return f"num_attention_heads={self.num_heads} does not divide by {size}"
        if self.intermediate_size % size and not all(self.layer_moe or [False]):
            return f"intermediate_size={self.intermediate_size} does not divide by {size}"
        if self.num_experts and self.moe_intermediate_size % size:
            # experts are split by their columns: every rank holds a share of each
            return (f"moe_intermediate_size={self.moe_intermediate_size} (each expert's "
                    f"columns) does not divide by {size}")
        if self.num_kv_heads % size and size % self.num_kv_heads:
            return (f"num_key_value_heads={self.num_kv_heads} neither divides by nor "
                    f"divides {size}")
        return None

    def valid_tp_sizes(self) -> list[int]:
        return [n for n in range(1, self.num_heads + 1) if self.tp_problem(n) is None]

    def check_tp(self, size: int) -> None:
        """Refuse a TP size this model cannot be split by, naming the sizes it can."""
        problem = self.tp_problem(size)
        if problem is not None:
            sizes = ", ".join(map(str, self.valid_tp_sizes()))
            raise ModelConfigError(f"tensor parallel size {size} cannot split this model: "
                                   f"{problem}; valid sizes: {sizes}")

    @staticmethod
    def from_dict(raw: dict[str, Any], *, max_model_len: int | None = None,
                  dtype: str | None = None, source: str = "config.json") -> ModelConfig:
        """Validate a parsed ``config.json``. ``max_model_len`` is the longest context the
        engine will serve (default: ``max_position_embeddings``); ``dtype`` overrides the
        checkpoint's."""
        return _parse(raw, max_model_len, dtype, source)

    def to_dict(self) -> dict[str, Any]:
        """A stable, JSON-able form (part of the model fingerprint)."""
        out = dict(self.__dict__)
        for name in ("rope_scaling", "local_rope_scaling"):
            s = getattr(self, name)
            out[name] = None if s is None else {k: list(v) if isinstance(v, tuple) else v
                                                for k, v in s.__dict__.items()}
        for name, value in out.items():
            if isinstance(value, tuple):
                out[name] = list(value)
        return out


def load_config(model_dir: str | Path, *, max_model_len: int | None = None,
                dtype: str | None = None) -> ModelConfig:
    """Read and validate ``model_dir/config.json``, or a GGUF file's metadata (``dtype``
    None keeps its quantized weights quantized; a dtype dequantizes them to it)."""

    if is_gguf(model_dir):
        return _gguf(Path(model_dir), max_model_len, dtype)
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"{path}: no config.json (is {model_dir} a Hugging Face "
                               f"model directory?)") from None
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"{path}: cannot read config.json: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{path}: config.json must hold a JSON object")
    return _parse(raw, max_model_len, dtype, str(path))


def _gguf(path: Path, max_model_len: int | None, dtype: str | None) -> ModelConfig:
    f = open_gguf(path)
    cfg = _parse(gguf_config(f, dtype), max_model_len, None, f"{path} (GGUF metadata)")
    factors = rope_freq_factors(f)
    if factors is not None and len(factors) != cfg.head_dim // 2:
        raise ModelConfigError(f"{path}: rope_freqs.weight holds {len(factors)} factors; "
                               f"head_dim {cfg.head_dim} needs {cfg.head_dim // 2}")
    # llama.cpp's Gemma converter stores each norm's 1 + w: the file's norms are plain
    return replace(cfg, rope_freq_factors=factors, norm_offset=0.0)


class _Fields:
    """Typed reads of one config dict; every refusal names the source and the field."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def bad(self, name: str, value: object, why: str) -> ModelConfigError:
        return ModelConfigError(f"{self.source}: {name}={value!r}: {why}")

    def int(self, name: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.raw.get(name, default)
        if value is None:
            raise self.bad(name, value, "required")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.bad(name, value, f"must be an integer >= {minimum}")
        return value

    def float(self, name: str, default: float) -> float:
        value = self.raw.get(name, default)
        if value is None:
            value = default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value > 0):
            raise self.bad(name, value, "must be a positive number")
        return float(value)

    def bool(self, name: str, default: bool) -> bool:
        value = self.raw.get(name, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.bad(name, value, "must be true or false")
        return value


def _architecture(f: _Fields) -> str:
    archs = f.raw.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1:
        raise f.bad("architectures", archs, f"must name exactly one of {sorted(ARCHITECTURES)}")
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise f.bad("architectures", archs, f"unknown architecture {arch!r}; this engine "
                    f"runs {sorted(ARCHITECTURES)}")
    return str(arch)


def _floats(p: _Fields, name: str, n: int) -> tuple[float, ...]:
    value = p.raw.get(name)
    if not isinstance(value, list) or len(value) != n or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in value):
        raise p.bad(name, value, f"must be a list of {n} positive numbers (one per rotary "
                                 f"frequency)")
    return tuple(float(v) for v in value)


def _scaling(f: _Fields, params: dict[str, Any], field: str,
             rotary_dim: int) -> RopeScaling | None:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise f.bad(f"{field}.rope_type", kind, f"unknown rope type; supported: "
                    f"{list(_ROPE_TYPES)}")
    if kind == "default":
        return None
    p = _Fields(params, f"{f.source} {field}")
    factor = p.float("factor", 1.0)
    if kind == "linear":
        return RopeScaling("linear", factor)
    if kind == "llama3":
        low, high = p.float("low_freq_factor", 1.0), p.float("high_freq_factor", 4.0)
        if high <= low:
            raise f.bad(f"{field}.high_freq_factor", high,
                        f"must exceed low_freq_factor ({low})")
        return RopeScaling("llama3", factor, low, high,
                           p.int("original_max_position_embeddings", 8192))
    attn = params.get("attention_factor")
    attention = None if attn is None else p.float("attention_factor", 1.0)
    # Phi-3 keeps original_max_position_embeddings beside rope_scaling, not in it
    old = params.get("original_max_position_embeddings",
                     f.raw.get("original_max_position_embeddings"))
    original = _Fields({"original_max_position_embeddings": old}, p.source).int(
        "original_max_position_embeddings")
    if kind == "yarn":
        if params.get("mscale") or params.get("mscale_all_dim"):
            raise f.bad(f"{field}.mscale", params.get("mscale"),
                        "yarn's mscale / mscale_all_dim (DeepSeek's) are not supported")
        return RopeScaling("yarn", factor, original_max_position_embeddings=original,
                           beta_fast=p.float("beta_fast", 32.0),
                           beta_slow=p.float("beta_slow", 1.0),
                           truncate=p.bool("truncate", True), attention_factor=attention)
    n = rotary_dim // 2   # longrope
    return RopeScaling("longrope", factor if "factor" in params else 1.0,
                       original_max_position_embeddings=original, attention_factor=attention,
                       short_factor=_floats(p, "short_factor", n),
                       long_factor=_floats(p, "long_factor", n))


def _rope(f: _Fields, rotary_dim: int) -> tuple[tuple[float, RopeScaling | None],
                                                tuple[float, RopeScaling | None] | None]:
    """(theta, scaling) of the full-attention layers, and of the sliding ones where they
    differ (Gemma 3: ``rope_parameters`` per layer kind in transformers 5.x,
    ``rope_local_base_freq`` in 4.x)."""
    params = f.raw.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params = f.raw.get("rope_scaling")
        field = "rope_scaling"
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        kinds = []
        for kind in (FULL, SLIDING):
            sub = params.get(kind)
            if not isinstance(sub, dict):
                raise f.bad(f"{field}.{kind}", sub, "must be an object")
            sf = _Fields(sub, f.source)
            kinds.append((sf.float("rope_theta", 10000.0),
                          _scaling(f, sub, f"{field}.{kind}", rotary_dim)))
        return kinds[0], kinds[1]
    theta_src = params if isinstance(params, dict) and "rope_theta" in params else f.raw
    theta = _Fields(theta_src, f.source).float("rope_theta", 10000.0)
    local = f.raw.get("rope_local_base_freq")
    sliding = None if local is None else (f.float("rope_local_base_freq", 10000.0), None)
    if params is None:
        return (theta, None), sliding
    if not isinstance(params, dict):
        raise f.bad(field, params, "must be an object")
    return (theta, _scaling(f, params, field, rotary_dim)), sliding


def _layer_kinds(f: _Fields, fam: Family, layers: int) -> tuple[int | None, tuple[bool, ...]]:
    """The sliding window and which layers use it: ``layer_types`` where the config lists
    them (Gemma, transformers 5.x), else the family's rule."""
    window = f.raw.get("sliding_window")
    kinds = f.raw.get("layer_types")
    if isinstance(kinds, list):
        if len(kinds) != layers or any(k not in (SLIDING, FULL) for k in kinds):
            raise f.bad("layer_types", kinds, f"must list {layers} of {SLIDING!r} and "
                                              f"{FULL!r}")
        sliding = tuple(k == SLIDING for k in kinds)
        if fam.qwen_window and not f.bool("use_sliding_window", False):
            sliding = (False,) * layers
    elif fam.gemma:   # Gemma 2 before layer_types: every other layer, the first sliding
        pattern = f.raw.get("sliding_window_pattern", f.raw.get("_sliding_window_pattern", 2))
        pattern = pattern if isinstance(pattern, int) and pattern > 0 else 2
        sliding = tuple(bool((i + 1) % pattern) for i in range(layers))
    elif fam.qwen_window and f.bool("use_sliding_window", False):
        first = f.int("max_window_layers", layers, minimum=0)
        sliding = tuple(i >= first for i in range(layers))
    elif fam.window:
        sliding = (window is not None,) * layers
    else:
        sliding = (False,) * layers
    if not any(sliding):
        return None, ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise f.bad("sliding_window", window, "must be a positive integer where layers slide")
    return window, sliding


def _moe(f: _Fields, fam: Family, layers: int) -> dict[str, Any]:
    if not fam.moe:
        return {}
    experts = f.int("num_local_experts", f.raw.get("num_experts"))
    top = f.int("num_experts_per_tok")
    if top > experts:
        raise f.bad("num_experts_per_tok", top, f"exceeds the {experts} experts")
    if fam.moe == "mixtral":
        return dict(moe_layout="mixtral", num_experts=experts, experts_per_tok=top,
                    moe_intermediate_size=f.int("intermediate_size"), norm_topk_prob=True,
                    layer_moe=(True,) * layers)
    step = f.int("decoder_sparse_step", 1)
    dense = f.raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise f.bad("mlp_only_layers", dense, "must be a list of layer indices")
    return dict(moe_layout="qwen", num_experts=experts, experts_per_tok=top,
                moe_intermediate_size=f.int("moe_intermediate_size"),
                norm_topk_prob=f.bool("norm_topk_prob", False),
                layer_moe=tuple(i not in dense and (i + 1) % step == 0
                                for i in range(layers)))


def _softcap(f: _Fields, name: str) -> float | None:
    return None if f.raw.get(name) is None else f.float(name, 1.0)


def _eos(f: _Fields) -> tuple[int, ...]:
    eos = f.raw.get("eos_token_id")
    if eos is None:
        return ()
    items = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(e, int) and not isinstance(e, bool) for e in items):
        raise f.bad("eos_token_id", eos, "must be a token id or a list of them")
    return tuple(items)


def _parse(raw: dict[str, Any], max_model_len: int | None, dtype: str | None,
           source: str) -> ModelConfig:
    f = _Fields(raw, source)
    arch = _architecture(f)
    fam = ARCHITECTURES[arch]
    act_field = "hidden_activation" if fam.gemma else "hidden_act"
    act = raw.get(act_field) or raw.get("hidden_act") or (
        "gelu_pytorch_tanh" if fam.gemma else "silu")
    if act not in _ACTIVATIONS:
        raise f.bad(act_field, act, f"supported: {sorted(_ACTIVATIONS)}")
    if f.bool("mlp_bias", False):
        raise f.bad("mlp_bias", True, "biases on the MLP are not supported")
    hidden, heads = f.int("hidden_size"), f.int("num_attention_heads")
    kv_heads = f.int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise f.bad("num_key_value_heads", kv_heads,
                    f"must divide num_attention_heads ({heads})")
    head_dim = raw.get("head_dim") or (hidden // heads)
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise f.bad("head_dim", head_dim, "must be a positive even integer")
    params = raw.get("rope_parameters")
    partial = (params.get("partial_rotary_factor") if isinstance(params, dict) else None) \
        or raw.get("partial_rotary_factor") or 1.0
    rotary_dim = int(head_dim * partial)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise f.bad("partial_rotary_factor", partial,
                    f"must leave an even rotary width within head_dim ({head_dim})")
    max_pos = f.int("max_position_embeddings", 2048)
    context = max_pos if max_model_len is None else max_model_len
    if context < 1 or context > max_pos:
        raise f.bad("max_model_len", context,
                    f"must be within 1..max_position_embeddings ({max_pos})")
    (theta, scaling), local = _rope(f, rotary_dim)
    layers = f.int("num_hidden_layers")
    window, sliding = _layer_kinds(f, fam, layers)
    attn_bias = f.bool("attention_bias", fam.qkv_bias)
    ckpt_dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    chosen = dtype or ckpt_dtype
    if chosen not in DTYPES:
        raise f.bad("dtype", chosen, f"supported: {list(DTYPES)}")
    bos = raw.get("bos_token_id")
    qpas = raw.get("query_pre_attn_scalar")
    return ModelConfig(
        architecture=arch,
        vocab_size=f.int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=f.int("intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=f.float("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        max_model_len=context,
        tie_word_embeddings=f.bool("tie_word_embeddings", fam.gemma),
        # Qwen2 has biases on q/k/v only; Llama's attention_bias covers o_proj too.
        qkv_bias=attn_bias or fam.qkv_bias,
        o_bias=attn_bias and arch == "LlamaForCausalLM",
        dtype=chosen,
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_ids=_eos(f),
        quantization=_quantization(f),
        qk_norm=fam.qk_norm,
        norm_offset=1.0 if fam.gemma else 0.0,
        sandwich_norms=fam.gemma,
        embed_scale=math.sqrt(hidden) if fam.gemma else 1.0,
        activation=_ACTIVATIONS[act],
        fused_qkv=fam.fused,
        attn_scale=None if qpas is None else f.float("query_pre_attn_scalar", 1.0) ** -0.5,
        attn_softcap=_softcap(f, "attn_logit_softcapping"),
        final_softcap=_softcap(f, "final_logit_softcapping"),
        rotary_dim=0 if rotary_dim == head_dim else rotary_dim,
        sliding_window=window,
        layer_sliding=sliding,
        local_rope_theta=None if local is None else local[0],
        local_rope_scaling=None if local is None else local[1],
        **_moe(f, fam, layers),
    )


def _quantization(f: _Fields) -> str:
    value = f.raw.get("quantization", "none")
    if value not in ("none", "gguf"):
        raise f.bad("quantization", value, "supported: none, gguf")
    return str(value)


def local_kv_heads(num_kv_heads: int, tp: int) -> int:
    """KV heads a rank holds: split when they divide by TP, else one replicated head per
    rank (each rank holds the head its query heads need)."""
    return num_kv_heads // tp if num_kv_heads % tp == 0 else 1
