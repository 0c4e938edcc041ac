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

__all__ = ["ARCHITECTURES", "DTYPES", "ModelConfig", "RopeScaling", "load_config",
           "local_kv_heads"]

# architecture -> (q/k/v bias by default, honours a sliding window)
ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, True),
    "MistralForCausalLM": (False, True),
}
DTYPES = ("float32", "bfloat16", "float16")
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """``rope_scaling``: ``linear`` divides positions by ``factor``; ``llama3`` rescales
    the low frequencies (Llama 3.1's long-context scheme)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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

    @property
    def kv_groups(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def tp_problem(self, size: int) -> str | None:
        """Why TP ``size`` cannot split this model (None: it can). Query heads and MLP
        columns split evenly; KV heads split, or are replicated when TP is a multiple of
        them (engine/model/transformer.py's Shard)."""
        if self.num_heads % size:
            return f"num_attention_heads={self.num_heads} does not divide by {size}"
        if self.intermediate_size % size:
            return f"intermediate_size={self.intermediate_size} does not divide by {size}"
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
        out["rope_scaling"] = None if self.rope_scaling is None else dict(
            self.rope_scaling.__dict__)
        out["eos_token_ids"] = list(self.eos_token_ids)
        if self.rope_freq_factors is not None:
            out["rope_freq_factors"] = list(self.rope_freq_factors)
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
    from .gguf_model import gguf_config, rope_freq_factors

    f = open_gguf(path)
    cfg = _parse(gguf_config(f, dtype), max_model_len, None, f"{path} (GGUF metadata)")
    factors = rope_freq_factors(f)
    if factors is not None and len(factors) != cfg.head_dim // 2:
        raise ModelConfigError(f"{path}: rope_freqs.weight holds {len(factors)} factors; "
                               f"head_dim {cfg.head_dim} needs {cfg.head_dim // 2}")
    return replace(cfg, rope_freq_factors=factors)


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


def _rope(f: _Fields) -> tuple[float, RopeScaling | None]:
    params = f.raw.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params = f.raw.get("rope_scaling")
        field = "rope_scaling"
    theta_src = params if isinstance(params, dict) and "rope_theta" in params else f.raw
    theta = _Fields(theta_src, f.source).float("rope_theta", 10000.0)
    if params is None:
        return theta, None
    if not isinstance(params, dict):
        raise f.bad(field, params, "must be an object")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise f.bad(f"{field}.rope_type", kind, f"unknown rope type; supported: "
                    f"{list(_ROPE_TYPES)}")
    if kind == "default":
        return theta, None
    p = _Fields(params, f"{f.source} {field}")
    factor = p.float("factor", 1.0)
    if kind == "linear":
        return theta, RopeScaling("linear", factor)
    low, high = p.float("low_freq_factor", 1.0), p.float("high_freq_factor", 4.0)
    if high <= low:
        raise f.bad(f"{field}.high_freq_factor", high,
                    f"must exceed low_freq_factor ({low})")
    return theta, RopeScaling("llama3", factor, low, high,
                              p.int("original_max_position_embeddings", 8192))


def _sliding_window(f: _Fields, arch: str, context: int) -> None:
    honours = ARCHITECTURES[arch][1]
    window = f.raw.get("sliding_window")
    used = honours and window is not None
    if arch == "Qwen2ForCausalLM":
        used = used and f.bool("use_sliding_window", False)
    if used and (not isinstance(window, int) or window < context):
        raise f.bad("sliding_window", window, f"shorter than the context ({context} tokens); "
                    f"this engine attends over the whole context and would answer "
                    f"differently (set max_model_len <= {window})")
    kinds = f.raw.get("layer_types")
    if isinstance(kinds, list) and used:
        odd = sorted({k for k in kinds if k != "full_attention"})
        if odd and not (isinstance(window, int) and window >= context):
            raise f.bad("layer_types", odd, "only full attention is supported")


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
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise f.bad("hidden_act", act, "only silu is supported")
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
    max_pos = f.int("max_position_embeddings", 2048)
    context = max_pos if max_model_len is None else max_model_len
    if context < 1 or context > max_pos:
        raise f.bad("max_model_len", context,
                    f"must be within 1..max_position_embeddings ({max_pos})")
    theta, scaling = _rope(f)
    _sliding_window(f, arch, context)
    qkv_default = ARCHITECTURES[arch][0]
    attn_bias = f.bool("attention_bias", qkv_default)
    ckpt_dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    chosen = dtype or ckpt_dtype
    if chosen not in DTYPES:
        raise f.bad("dtype", chosen, f"supported: {list(DTYPES)}")
    bos = raw.get("bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=f.int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=f.int("intermediate_size"),
        num_layers=f.int("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=f.float("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        max_model_len=context,
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
        # Qwen2 has biases on q/k/v only; Llama's attention_bias covers o_proj too.
        qkv_bias=attn_bias or qkv_default,
        o_bias=attn_bias and arch == "LlamaForCausalLM",
        dtype=chosen,
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_ids=_eos(f),
        quantization=_quantization(f),
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
