"""The embedded default model: a small Llama checkpoint phalanx writes itself.

With no model given, the engine serves this one. It is written deterministically in
Hugging Face format (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` with a chat template, ``generation_config.json``) into
``$XDG_CACHE_HOME/phalanx/models/<name>-<digest>/`` on first use, then loaded through
the same loader as any checkpoint. Same bytes on every machine: the weights come from
PCG64's raw output (a bit stream numpy guarantees stable, unlike its distributions)
turned into uniform floats here; the safetensors file and the tokenizer are serialised
here too, not by libraries whose output format may change. ``FORMAT`` goes into the
digest: bump it whenever a change alters a written byte (a test pins the digests).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import ModelConfigError
from ._corpus import CORPUS
from .bpe import tokenizer_json, train_merges
from .config import ARCHITECTURES, DTYPES

__all__ = ["DEFAULT_SPEC", "FORMAT", "ModelSpec", "default_model_dir", "ensure_default_model",
           "write_model"]

FORMAT = 1
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_ARCH_NAMES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "mistral": "MistralForCausalLM"}
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
# logits std of the LM head on a unit-RMS hidden state: peaked enough that greedy
# decoding is decided by clear margins, not near-ties
_HEAD_GAIN = 3.0


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a written model (``phalanx model init`` flags)."""

    name: str = "phalanx-tiny"
    arch: str = "llama"
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 688
    vocab: int = 1472
    dtype: str = "float32"
    seed: int = 0
    max_position: int = 4096
    tie: bool = False

    def validate(self) -> None:
        def bad(field: str, value: object, why: str) -> ModelConfigError:
            return ModelConfigError(f"model spec {field}={value!r}: {why}")
        if self.arch not in _ARCH_NAMES:
            raise bad("arch", self.arch, f"choose one of {sorted(_ARCH_NAMES)}")
        if self.dtype not in DTYPES:
            raise bad("dtype", self.dtype, f"choose one of {list(DTYPES)}")
        for field in ("layers", "hidden", "heads", "kv_heads", "intermediate",
                      "max_position"):
            if getattr(self, field) < 1:
                raise bad(field, getattr(self, field), "must be >= 1")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise bad("hidden", self.hidden, f"must be an even multiple of heads "
                      f"({self.heads}) per head")
        if self.heads % self.kv_heads:
            raise bad("kv_heads", self.kv_heads, f"must divide heads ({self.heads})")
        if self.vocab < 256 + len(SPECIALS):
            raise bad("vocab", self.vocab, f"must be >= {256 + len(SPECIALS)} (bytes and "
                      f"special tokens)")

    def digest(self) -> str:
        body = json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()[:16]


DEFAULT_SPEC = ModelSpec()


def default_model_dir(cache_dir: str | Path | None = None,
                      spec: ModelSpec = DEFAULT_SPEC) -> Path:
    """The embedded model's directory, written on first use (``cache_dir`` defaults to
    ``$XDG_CACHE_HOME/phalanx/models`` or ``~/.cache/phalanx/models``)."""
    if cache_dir is None:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        cache_dir = Path(base) / "phalanx" / "models"
    root = Path(cache_dir)
    target = root / f"{spec.name}-{spec.digest()}"
    if (target / "config.json").exists():
        return target
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_model(target, spec)
    return target


def ensure_default_model(cache_dir: str | Path | None = None) -> Path:
    """The embedded default model's directory, written on first use (what
    ``phalanx.LLM(model=None)`` serves)."""
    return default_model_dir(cache_dir)


def write_model(target: str | Path, spec: ModelSpec = DEFAULT_SPEC) -> Path:
    """Write a model of ``spec`` at ``target`` (which must not exist): into a temporary
    sibling first, renamed into place when complete, so a reader never sees half a
    model. Two writers racing: the second finds the first's directory and keeps it."""
    spec.validate()
    target = Path(target)
    if target.exists():
        raise ModelConfigError(f"{target}: already exists; choose a new directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        os.chmod(tmp, 0o700)
        for name, data in _files(spec).items():
            fd = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():
                raise
            shutil.rmtree(tmp)  # another process wrote the same model first
    except BaseException:  # any interruption: the temporary directory must not stay
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _files(spec: ModelSpec) -> dict[str, bytes]:
    _, tok = _tokenizer(spec.vocab)
    n_tok = len(json.loads(tok)["model"]["vocab"])
    ids = {s: n_tok - len(SPECIALS) + i for i, s in enumerate(SPECIALS)}
    eos = [ids["<|im_end|>"], ids["</s>"]]
    return {
        "config.json": _json(_config(spec, ids["<s>"], eos)),
        "generation_config.json": _json({"bos_token_id": ids["<s>"], "eos_token_id": eos,
                                         "do_sample": False}),
        "model.safetensors": _safetensors(_weights(spec), spec.dtype),
        "tokenizer.json": tok.encode(),
        "tokenizer_config.json": _json({
            "add_bos_token": False, "add_eos_token": False, "bos_token": "<s>",
            "eos_token": "<|im_end|>", "pad_token": "</s>", "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False, "model_max_length": spec.max_position,
            "tokenizer_class": "PreTrainedTokenizerFast"}),
    }


def _json(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def _tokenizer(vocab: int) -> tuple[list[tuple[str, str]], str]:
    """Merges so that bytes + merges + specials fill ``vocab`` ids where the text has
    enough pairs (a larger model vocab keeps ids above the tokenizer's unused)."""
    want = vocab - 256 - len(SPECIALS)
    merges = train_merges(CORPUS, want)
    seen: set[str] = set()
    kept: list[tuple[str, str]] = []
    for a, b in merges:  # two merges can spell the same token: count tokens, not merges
        if len(seen) == want:
            break
        kept.append((a, b))
        seen.add(a + b)
    return kept, tokenizer_json(kept, SPECIALS)


def _config(spec: ModelSpec, bos: int, eos: list[int]) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "architectures": [_ARCH_NAMES[spec.arch]], "model_type": spec.arch,
        "vocab_size": spec.vocab, "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate, "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.hidden // spec.heads, "hidden_act": "silu",
        "max_position_embeddings": spec.max_position, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "rope_scaling": None,
        "tie_word_embeddings": spec.tie, "dtype": spec.dtype,
        "bos_token_id": bos, "eos_token_id": eos, "initializer_range": 0.02,
        "attention_dropout": 0.0, "use_cache": True,
    }
    if spec.arch == "llama":
        doc.update(attention_bias=False, mlp_bias=False)
    elif spec.arch == "qwen2":
        doc.update(use_sliding_window=False, sliding_window=None)
    else:
        doc.update(sliding_window=None)
    assert doc["architectures"][0] in ARCHITECTURES  # the writer names what the loader reads
    return doc


def _weights(spec: ModelSpec) -> dict[str, np.ndarray]:
    """float32 weights, drawn in name order from one PCG64 stream."""
    rng = np.random.Generator(np.random.PCG64(spec.seed)).bit_generator
    h, d = spec.hidden, spec.hidden // spec.heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab, h),
                                          "model.norm.weight": (h,)}
    if not spec.tie:
        shapes["lm_head.weight"] = (spec.vocab, h)
    for i in range(spec.layers):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (spec.heads * d, h),
            f"{p}.self_attn.k_proj.weight": (spec.kv_heads * d, h),
            f"{p}.self_attn.v_proj.weight": (spec.kv_heads * d, h),
            f"{p}.self_attn.o_proj.weight": (h, spec.heads * d),
            f"{p}.mlp.gate_proj.weight": (spec.intermediate, h),
            f"{p}.mlp.up_proj.weight": (spec.intermediate, h),
            f"{p}.mlp.down_proj.weight": (h, spec.intermediate),
        })
        if spec.arch == "qwen2":
            for proj, rows in (("q", spec.heads * d), ("k", spec.kv_heads * d),
                               ("v", spec.kv_heads * d)):
                shapes[f"{p}.self_attn.{proj}_proj.bias"] = (rows,)
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            out[name] = np.ones(shape, np.float32)
            continue
        n = math.prod(shape)
        raw = rng.random_raw(n)
        u = ((raw >> np.uint64(11)).astype(np.float64) * 2.0 ** -53) * 2.0 - 1.0
        if name.endswith(".bias"):
            std = 0.1
        elif name == "model.embed_tokens.weight":
            std = 1.0
        else:
            std = (_HEAD_GAIN if name == "lm_head.weight" else 1.0) / math.sqrt(shape[1])
        out[name] = (u * (std * math.sqrt(3.0))).astype(np.float32).reshape(shape)
    return out


def _safetensors(tensors: dict[str, np.ndarray], dtype: str) -> bytes:
    """The safetensors format, serialised here: an 8-byte header length, a JSON header
    (sorted, compact, space-padded to 8 bytes) and the tensors in name order."""
    blobs: list[bytes] = []
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(tensors):
        data = _cast(tensors[name], dtype)
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(blobs)


def _cast(a: np.ndarray, dtype: str) -> bytes:
    a = np.ascontiguousarray(a, dtype="<f4")
    if dtype == "float32":
        return a.tobytes()
    if dtype == "float16":
        return a.astype("<f2").tobytes()
    bits = a.view("<u4").astype(np.uint64)  # bfloat16: round to nearest even
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()
