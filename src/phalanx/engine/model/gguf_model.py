"""A GGUF file as the decoder sees it: a Hugging Face config and checkpoint names.

llama.cpp's converter renames every tensor (``model.layers.3.mlp.up_proj`` becomes
``blk.3.ffn_up``), moves the config into ``{arch}.*`` metadata keys and, for the Llama
architecture, permutes the rows of each Q and K head so that its rotary pairs sit side
by side (GGUF rotates interleaved pairs; Hugging Face rotates halves). This module maps
all three back, so the same decoder serves a safetensors directory and a GGUF file and
the two give the same tokens:

- :func:`gguf_config` builds the ``config.json`` dict from the metadata;
- :class:`GGUFCheckpoint` reads tensors by their Hugging Face names, one rank's slice at
  a time (rows of quantized tensors are whole blocks: a row slice costs no decode), with
  the Q/K rows un-permuted per head, dequantized with the ``gguf`` package, or handed
  over still quantized (:meth:`GGUFCheckpoint.read_quantized`) for engine/model/quant.py.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from .._errors import CheckpointError, ModelConfigError
from .gguf_file import KEPT_QUANTIZED, GGUFFile, GGUFTensor, open_gguf
from .weights import LoadReport, ReadLedger

if TYPE_CHECKING:
    import numpy as np
    import torch

    from .quant import QuantTensor

log = logging.getLogger("phalanx.engine")

__all__ = ["ARCHS", "GGUFCheckpoint", "gguf_config"]

# general.architecture -> the Hugging Face class (Mistral's and Mixtral's converters write
# "llama"; a "llama" file with experts is Mixtral).
ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "qwen3moe": "Qwen3MoeForCausalLM", "gemma2": "Gemma2ForCausalLM",
         "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
# Architectures whose converter permuted Q/K rows per head (LlamaModel.permute).
_PERMUTED = ("llama", "mistral")

_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
# Gemma's four norms: its post_attention_layernorm follows attention (Llama's precedes
# the MLP, which is Gemma's pre_feedforward_layernorm)
_GEMMA_LAYER = {"post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
# mixture of experts: the router, and each expert's rows of one 3-D tensor per projection
_MOE = {"qwen3moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
        "llama": ("block_sparse_moe", "w1", "w3", "w2")}
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
# GGUF tensors the decoder does not read as weights (the config reads them).
_NOT_WEIGHTS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# an expert's tensor: "<3-D GGUF tensor>#<expert>"
_EXPERT = "#"


def _layer_map(arch: str) -> dict[str, str]:
    """GGUF layer tensor -> its Hugging Face name under ``model.layers.N``."""
    names = dict(_LAYER)
    if arch == "phi3":       # fused gate/up is ffn_up there
        del names["mlp.up_proj"]
    else:
        del names["mlp.gate_up_proj"]
    if arch.startswith("gemma"):
        names.update(_GEMMA_LAYER)
    return {v: k for k, v in names.items()}


def _hf_names(f: GGUFFile) -> dict[str, str]:
    """Hugging Face name -> GGUF name of every tensor the decoder may read (an expert's
    slice of a 3-D tensor as ``name#expert``)."""
    arch = str(f.get("general.architecture"))
    back = {"token_embd.weight": "model.embed_tokens.weight",
            "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
    inv = _layer_map(arch)
    moe = _MOE.get(arch) if f.get(f"{arch}.expert_count") else None
    out: dict[str, str] = {}
    for name in f.tensors:
        hf = back.get(name)
        m = _GGUF_LAYER.match(name)
        if m and m.group(2) in inv:
            hf = f"model.layers.{m.group(1)}.{inv[m.group(2)]}.{m.group(3)}"
        elif m and moe is not None:
            block = f"model.layers.{m.group(1)}.{moe[0]}"
            if m.group(2) == "ffn_gate_inp":
                hf = f"{block}.gate.weight"
            for proj, kind in zip(moe[1:], ("gate", "up", "down"), strict=True):
                if m.group(2) == f"ffn_{kind}_exps":
                    for e in range(f.tensors[name].shape[0]):
                        out[f"{block}.experts.{e}.{proj}.weight"] = f"{name}{_EXPERT}{e}"
        if hf is not None:
            out[hf] = name
    return out


def _family(f: GGUFFile, arch: str, raw: dict[str, Any]) -> None:
    """The per-family fields of ``raw`` from ``{arch}.*`` keys, as llama.cpp reads them."""
    layers = int(raw["num_hidden_layers"])
    experts = f.get(f"{arch}.expert_count")
    if experts:
        if arch not in _MOE:
            raise ModelConfigError(f"{f.path}: {arch} with {arch}.expert_count={experts} "
                                   f"(mixture of experts) is not served by this engine")
        raw["num_local_experts"] = int(experts)
        raw["num_experts_per_tok"] = int(f.need(f"{arch}.expert_used_count"))
        if arch == "llama":
            raw["architectures"] = ["MixtralForCausalLM"]
        else:   # llama.cpp renormalises the top-k weights of qwen3moe
            raw["moe_intermediate_size"] = f.need(f"{arch}.expert_feed_forward_length")
            raw["norm_topk_prob"] = True
    if arch.startswith("gemma"):
        # llama.cpp scales scores by head_dim ** -0.5, or by (hidden / heads) ** -0.5 for
        # the 27B models (query_pre_attn_scalar is not in the file)
        big = layers == (46 if arch == "gemma2" else 62)
        raw["query_pre_attn_scalar"] = (raw["hidden_size"] // raw["num_attention_heads"]
                                        if big else raw["head_dim"])
        pattern = int(f.get(f"{arch}.attention.sliding_window_pattern",
                            2 if arch == "gemma2" else 6))
        raw["layer_types"] = ["sliding_attention" if i % pattern < pattern - 1
                              else "full_attention" for i in range(layers)]
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if f.get(f"{arch}.{key}") is not None:
                raw[key] = float(f.get(f"{arch}.{key}"))
        if f.get(f"{arch}.rope.freq_base_swa") is not None:
            raw["rope_local_base_freq"] = float(f.get(f"{arch}.rope.freq_base_swa"))
    if arch == "phi3":
        rot = f.get(f"{arch}.rope.dimension_count")
        if rot:
            raw["partial_rotary_factor"] = int(rot) / int(raw["head_dim"])
        long, short = (f.tensors.get(f"rope_factors_{k}.weight") for k in ("long", "short"))
        if long is not None and short is not None:
            raw["rope_scaling"] = {
                "rope_type": "longrope",
                "long_factor": [float(v) for v in long.data.reshape(-1)],
                "short_factor": [float(v) for v in short.data.reshape(-1)],
                "original_max_position_embeddings": f.need(
                    f"{arch}.rope.scaling.original_context_length"),
                "attention_factor": f.get(f"{arch}.rope.scaling.attn_factor")}


def gguf_config(f: GGUFFile, dtype: str | None) -> dict[str, Any]:
    """The ``config.json`` of the model in ``f``; ``dtype`` None keeps the kept types'
    weights quantized (the model around them in float32: engine/model/quant.py), a dtype
    dequantizes every weight to it."""
    arch = f.need("general.architecture")
    if arch not in ARCHS:
        raise ModelConfigError(f"{f.path}: general.architecture={arch!r} is not served by "
                               f"this engine (it runs {', '.join(sorted(ARCHS))})")
    heads = int(f.need(f"{arch}.attention.head_count"))
    hidden = int(f.need(f"{arch}.embedding_length"))
    tokens = f.get("tokenizer.ggml.tokens")
    vocab = f.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        embd = f.tensors.get("token_embd.weight")
        vocab = embd.shape[0] if embd is not None else None
    raw: dict[str, Any] = {
        "architectures": [ARCHS[arch]],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": f.need(f"{arch}.feed_forward_length"),
        "num_hidden_layers": f.need(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": f.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": f.get(f"{arch}.attention.key_length") or hidden // heads,
        "rms_norm_eps": f.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": f.get(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": f.get(f"{arch}.context_length", 2048),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "attention_bias": "blk.0.attn_q.bias" in f.tensors,
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": [int(i) for i in (f.get("tokenizer.ggml.eos_token_id"),
                                          f.get("tokenizer.ggml.eot_token_id"),
                                          f.get("tokenizer.ggml.eom_token_id"))
                         if isinstance(i, int)],
    }
    window = f.get(f"{arch}.attention.sliding_window")
    if window:
        raw["sliding_window"] = window
    scaling = f.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        factor = f.get(f"{arch}.rope.scaling.factor", 1.0)
        if scaling == "linear":
            raw["rope_scaling"] = {"rope_type": "linear", "factor": factor}
        elif scaling == "yarn":
            pre = f"{arch}.rope.scaling."
            raw["rope_scaling"] = {
                "rope_type": "yarn", "factor": factor,
                "original_max_position_embeddings": f.need(pre + "original_context_length"),
                "attention_factor": f.get(pre + "yarn_attn_factor"),
                "beta_fast": f.get(pre + "yarn_beta_fast"),
                "beta_slow": f.get(pre + "yarn_beta_slow")}
        else:
            raise ModelConfigError(f"{f.path}: {arch}.rope.scaling.type={scaling!r} is not "
                                   f"supported (linear, yarn, and llama3 frequency factors "
                                   f"are)")
    _family(f, arch, raw)
    kept = any(t.qtype in KEPT_QUANTIZED for t in f.tensors.values())
    if dtype is None:
        dtype = "float32" if kept else _float_dtype(f)
        raw["quantization"] = "gguf" if kept else "none"
        if kept:
            _name_dequantized(f, dtype)
    else:
        raw["quantization"] = "none"
    raw["dtype"] = dtype
    return raw


_NAMED: set[Path] = set()


def _name_dequantized(f: GGUFFile, dtype: str) -> None:
    """One line at start naming the quantized types this engine does not keep (Q2_K,
    Q3_K: engine/model/quant.py) and what they become; once per process and file (a
    start reads the config several times)."""
    if f.path in _NAMED:
        return
    _NAMED.add(f.path)
    left: dict[str, int] = {}
    for t in f.tensors.values():
        if t.quantized and t.qtype not in KEPT_QUANTIZED and len(t.shape) == 2:
            left[t.qtype] = left.get(t.qtype, 0) + 1
    if left:
        types = ", ".join(f"{n} {q}" for q, n in sorted(left.items()))
        log.warning("%s: %s tensors are not kept quantized by this engine: dequantized "
                    "to %s at load", f.path.name, types, dtype)


def rope_freq_factors(f: GGUFFile) -> tuple[float, ...] | None:
    """Llama 3.x's long-context rope: the converter stores one divisor per frequency as
    the tensor ``rope_freqs.weight`` instead of config fields."""
    t = f.tensors.get("rope_freqs.weight")
    if t is None:
        return None
    return tuple(float(v) for v in t.data.astype("float32").reshape(-1))


def _float_dtype(f: GGUFFile) -> str:
    types = {t.qtype for t in f.tensors.values() if len(t.shape) == 2}
    return {frozenset({"F16"}): "float16", frozenset({"BF16"}): "bfloat16"}.get(
        frozenset(types), "float32")


class GGUFCheckpoint:
    """The tensors of one GGUF file under their Hugging Face names, read by slices (the
    same surface as :class:`~phalanx.engine.model.checkpoint.Checkpoint`)."""

    def __init__(self, path: str | Path, file: GGUFFile | None = None) -> None:
        self.file = file or open_gguf(path)
        self.dir = self.file.path
        arch = self.file.get("general.architecture")
        self._permuted = arch in _PERMUTED
        self._heads = int(self.file.get(f"{arch}.attention.head_count", 1))
        self._kv_heads = int(self.file.get(f"{arch}.attention.head_count_kv", self._heads))
        self._where = _hf_names(self.file)
        self._ledger = ReadLedger(self._where)

    def __enter__(self) -> GGUFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Nothing to close: the reader's memory map goes with the last reference."""

    def names(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def _lookup(self, where: str) -> GGUFTensor:
        """The tensor ``where`` names: a whole GGUF tensor, or one expert's [rows, cols]
        of a 3-D one (its leading index: the reader's array is [experts, rows, ...])."""
        if _EXPERT not in where:
            return self.file.tensors[where]
        name, e = where.split(_EXPERT)
        t = self.file.tensors[name]
        return GGUFTensor(name, t.qtype, t.shape[1:], t.data[int(e)])

    def shape(self, name: str) -> list[int]:
        return list(self._lookup(self._where[name]).shape)

    def skip(self, name: str) -> None:
        self._ledger.skip(name)

    def report(self) -> LoadReport:
        """Missing and unexpected tensors of the load so far; a GGUF tensor with no
        Hugging Face name is unexpected too."""
        mapped = {w.split(_EXPERT)[0] for w in self._where.values()}
        return self._ledger.report(unmapped=[
            n for n in self.file.tensors if n not in mapped and n not in _NOT_WEIGHTS])

    # -- reads -------------------------------------------------------------------------
    def _tensor(self, name: str) -> GGUFTensor | None:
        where = self._where.get(name)
        if where is None:
            self._ledger.absent(name)
            return None
        return self._lookup(where)

    def _rows(self, name: str, t: GGUFTensor, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of ``t`` in Hugging Face order (Q/K heads un-permuted)."""

        if not (self._permuted and len(t.shape) == 2 and
                name.endswith(("q_proj.weight", "k_proj.weight"))):
            return np.asarray(t.data[start:stop])
        heads = self._heads if name.endswith("q_proj.weight") else self._kv_heads
        d = t.shape[0] // heads
        r = np.arange(start, stop)
        head, within = r // d, r % d
        half, i = within // (d // 2), within % (d // 2)
        return np.asarray(t.data[head * d + i * 2 + half])

    def _check(self, name: str, t: GGUFTensor, dim: int, start: int, stop: int) -> None:
        if not 0 <= start < stop <= t.shape[dim]:
            raise CheckpointError(f"{self.dir}: {name} ({t.name}) has shape {list(t.shape)}; "
                                  f"slice [{start}, {stop}) of dim {dim} is out of range")

    def read(self, name: str, dim: int | None = None, start: int = 0,
             stop: int | None = None) -> torch.Tensor | None:
        """Tensor ``name`` (or ``[start, stop)`` of ``dim``) dequantized to float32; None
        (recorded as missing) when the file lacks it."""
        import torch

        t = self._tensor(name)
        if t is None:
            return None
        d = 0 if dim is None else dim
        end = t.shape[d] if stop is None or dim is None else stop
        begin = 0 if dim is None else start
        self._check(name, t, d, begin, end)
        rows = self._rows(name, t, begin, end) if d == 0 else self._rows(name, t, 0, t.shape[0])
        self._ledger.took(name, rows.nbytes)
        values = dequantize(rows, GGMLQuantizationType[t.qtype]) if t.quantized else rows
        # a copy: the rows may be a view of the read-only memory map
        out = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(
            (end - begin, *t.shape[1:]) if d == 0 else (t.shape[0], t.shape[1]))
        return out if d == 0 else out[:, begin:end].contiguous()

    def read_quantized(self, name: str, dim: int, start: int, stop: int) -> QuantTensor | None:
        """This rank's slice of ``name`` still in its GGUF blocks, when its type is kept
        quantized and the slice falls on block bounds; None otherwise (read it dense)."""
        # here, not at the top: the parent reads a GGUF file's config through this
        # module and must not import torch for it (quant.py does: ~120 MB)
        from .quant import QuantTensor

        where = self._where.get(name)
        if where is None:
            return None
        t = self._lookup(where)
        if t.qtype not in KEPT_QUANTIZED or len(t.shape) != 2:
            return None
        block = QuantTensor.block_size(t.qtype)
        if dim == 1 and (start % block or stop % block):
            return None
        self._check(name, t, dim, start, stop)
        if dim == 0:
            rows = self._rows(name, t, start, stop)
            cols = t.shape[1]
        else:
            per = QuantTensor.block_bytes(t.qtype)
            rows = self._rows(name, t, 0, t.shape[0])[:, start // block * per:
                                                         stop // block * per]
            cols = stop - start
        self._ledger.took(name, rows.nbytes)
        return QuantTensor(t.qtype, rows, cols)
