"""Every architecture family (issue 44) through the one decoder, against transformers.

Each family is a tiny seeded checkpoint written by transformers (tests/arch_models.py)
and its float32 GGUF made by llama.cpp's own converter. The oracle is transformers'
greedy generation of 8 prompts x 32 tokens in one batch; the engine must give the same
tokens at TP 1 (in this process) and at TP 2 (two rank processes of one module Worker),
from the directory and from the GGUF. The cases cover: Qwen3 (q/k norms) with yarn
scaling; Qwen3-MoE and Mixtral (top-2 of 4 experts, split over the ranks by columns);
Gemma 2 (soft-caps, a window of 8 on alternate layers) and Gemma 3 (5 sliding layers
and a global one with its own rope, one KV head: replicated at TP 2); Phi-3 (fused
q/k/v and gate/up, longrope past its original context of 32 from the prompt on, half
the head rotated).
Sliding windows: the prompt (37 tokens) exceeds the window (8), and a prefix read from
the cache's pages continues exactly as when recomputed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import phalanx
from arch_models import SP_VOCAB, convert, family_checkpoint, smollm_vocab, vocab_gguf
from engine_oracle import (
    PAGE_TOKENS,
    engine_generate,
    engine_generate_batch,
    hf_generate,
    prompts,
)
from phalanx.engine.model.config import ModelConfig, load_config
from phalanx.engine.model.gguf_file import forget_gguf_files
from phalanx.engine.worker.runner import Runner

# name: (arch, tokenizer, config overrides)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3-yarn": ("qwen3", "sp", dict(rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "rope_theta": 10_000.0})),
    "qwen3_moe": ("qwen3_moe", "gpt2", {}),
    "mixtral": ("mixtral", "sp", {}),
    "gemma2": ("gemma2", "sp", {}),
    "gemma3-kv1": ("gemma3", "sp", dict(num_key_value_heads=1)),
    "phi3-longrope": ("phi3", "sp", dict(
        original_max_position_embeddings=32, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 3.0, 5.0, 8.0],
            "original_max_position_embeddings": 32})),
}
BATCH = prompts(vocab=SP_VOCAB - 40)
PAGES = len(BATCH) * 5


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, tuple[Path, list[list[int]]]]:
    """Each family's directory and transformers' tokens for ``BATCH``."""
    root = tmp_path_factory.mktemp("archs")
    out = {}
    for i, (name, (arch, tok, kw)) in enumerate(FAMILIES.items()):
        path = family_checkpoint(root / name, arch, tok, seed=40 + i, **kw)
        out[name] = (path, hf_generate(path, BATCH))
    return out


@pytest.fixture(scope="module")
def ggufs(models: dict[str, tuple[Path, list[list[int]]]]) -> Iterator[dict[str, Path]]:
    yield convert({name: path for name, (path, _) in models.items()})
    forget_gguf_files()   # a parsed file holds its descriptor while kept


@pytest.fixture(scope="module")
def worker() -> Iterator[phalanx.Worker]:
    with phalanx.Worker(ranks=2, task_timeout=240) as w:
        yield w


def _source(name: str, kind: str, models: dict[str, Any], ggufs: dict[str, Path]) -> Path:
    return models[name][0] if kind == "dir" else ggufs[name]


@pytest.mark.parametrize("kind", ["dir", "gguf"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_tokens_equal_transformers_tp1(models: dict[str, Any],
                                              ggufs: dict[str, Path], name: str,
                                              kind: str) -> None:
    path = _source(name, kind, models, ggufs)
    runner = Runner(path, num_pages=PAGES, page_tokens=PAGE_TOKENS, threads=1)
    try:
        assert runner.report.missing == [] and runner.report.unexpected == []
        assert engine_generate_batch(runner, BATCH) == models[name][1]
    finally:
        runner.close()


def _rank_batch(d: Any, path: Path) -> dict[str, Any]:
    from phalanx.engine.worker.tp import DomainComm

    runner = Runner(path, DomainComm(d), num_pages=PAGES, page_tokens=PAGE_TOKENS)
    try:
        return {"tokens": engine_generate_batch(runner, BATCH),
                "kv_heads": runner.model.shard.kv_heads, "report": runner.report.to_dict(),
                "memory": runner.memory()}
    finally:
        runner.close()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_tokens_equal_transformers_tp2(worker: phalanx.Worker,
                                              models: dict[str, Any],
                                              ggufs: dict[str, Path], name: str) -> None:
    """TP 2 from the directory and from the GGUF, one domain for both loads."""
    def orch(o: Any) -> list[list[dict[str, Any]]]:
        d = o.allocate_domain("tp", ranks=[0, 1], window_size=256 << 10)
        out = []
        for path in (models[name][0], ggufs[name]):
            futures = [o.submit(r, _rank_batch, d, path) for r in range(2)]
            out.append([f.result() for f in futures])
        o.release_domain(d)
        return out

    cfg = load_config(models[name][0])
    for kind, results in zip(("dir", "gguf"), worker.run(orch), strict=True):
        for res in results:
            assert res["tokens"] == models[name][1]
            assert res["report"]["missing"] == [] and res["report"]["unexpected"] == []
            if kind == "dir":   # a dense GGUF's column slices are read as whole rows
                assert res["memory"].weight_bytes == res["memory"].bytes_read
            # one KV head (Gemma 3's small models) is replicated: each rank holds it
            assert res["kv_heads"] == max(1, cfg.num_kv_heads // 2)


@pytest.mark.parametrize("name", ["gemma2", "gemma3-kv1"])
def test_sliding_window_prefix_from_cache_equals_recomputed(models: dict[str, Any],
                                                            name: str) -> None:
    """A prompt past the window, its first 32 positions read from the pages another
    sequence wrote (a prefix-cache hit), continues as the whole prompt recomputed: the
    cached pages hold every position, and the window masks the same ones either way."""
    prompt = BATCH[0]
    runner = Runner(models[name][0], num_pages=12, page_tokens=PAGE_TOKENS, threads=1)
    try:
        full_logits, full = engine_generate(runner, prompt, new_tokens=8, seq_id=1,
                                            chunk=len(prompt))
        cached_logits, cached = engine_generate(runner, prompt, new_tokens=8, seq_id=2,
                                                cached=32)
        assert cached == full == models[name][1][0][:8]
        err = (cached_logits - full_logits[32:]).abs().max().item()
        assert err <= 1e-5, err
    finally:
        runner.close()


def test_moe_routes_top_k_of_the_experts(models: dict[str, Any]) -> None:
    """Each token goes to experts_per_tok experts, and different tokens to different ones
    (the router is exercised, not one fixed expert)."""
    cfg = load_config(models["mixtral"][0])
    runner = Runner(models["mixtral"][0], num_pages=PAGES, page_tokens=PAGE_TOKENS,
                    threads=1)
    try:
        moe = runner.model.layers[0].mlp
        seen: list[torch.Tensor] = []
        handle = moe.gate.register_forward_hook(
            lambda mod, args, out: seen.append(torch.topk(out, cfg.experts_per_tok).indices))
        engine_generate_batch(runner, BATCH[:2], new_tokens=1)
        handle.remove()
        chosen = torch.cat(seen)
        assert chosen.shape[1] == cfg.experts_per_tok == 2
        assert len(torch.unique(chosen)) == cfg.num_experts == 4
    finally:
        runner.close()


TEXTS = ["Hello world, 1234 h\u00e9llo  <start_of_turn>user\nWhat? \u00fcn\u00efc\u00f8d\u00e9 "
         "\U0001f642 tabs\tand  spaces", " leading space", "The quick brown fox.\n\nNew 3.14159",
         "  two", "a<end_of_turn>b", "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8"]


def test_a_sentencepiece_gguf_tokenizes_as_transformers(models: dict[str, Any],
                                                       ggufs: dict[str, Path]) -> None:
    """Gemma's kind of vocabulary (``tokenizer.ggml.model`` llama: SentencePiece BPE with
    byte fallback, no space prefix, control turn markers) from the GGUF's metadata gives
    transformers' ids (GemmaTokenizer on the directory's tokenizer.model), decodes as it
    does, and renders the file's chat template as transformers renders the directory's."""
    import transformers

    from phalanx.engine.model.tokenizer import Tokenizer

    ours = Tokenizer(ggufs["gemma3-kv1"])
    theirs = transformers.GemmaTokenizer.from_pretrained(str(models["gemma3-kv1"][0]))
    for text in TEXTS:
        ids = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.encode(TEXTS[0]) == theirs.encode(TEXTS[0])   # with BOS
    chat = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hi"},
            {"role": "user", "content": "Bye"}]
    text = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(chat) == text
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(
        text, add_special_tokens=False)


def test_the_qwen2_pre_tokenizer_of_a_gguf_tokenizes_as_transformers(
        tmp_path: Path) -> None:
    """``tokenizer.ggml.pre`` "qwen2" (Qwen2, Qwen3): a byte-level vocabulary split by
    Qwen's regex after NFC gives the ids of transformers' Qwen2Tokenizer built from the
    same vocabulary and merges (SmolLM2's: a real 49k vocabulary; Qwen's own is not
    available offline)."""
    import transformers

    from phalanx.engine.model.tokenizer import Tokenizer

    v = smollm_vocab()
    ours = Tokenizer(vocab_gguf(tmp_path / "vocab.gguf", "qwen2"))
    theirs = transformers.Qwen2Tokenizer(
        vocab={t: i for i, t in enumerate(v["tokens"])},
        merges=[tuple(m.split(" ", 1)) for m in v["merges"]])
    for text in [*TEXTS, "I'm here, you're THERE's 3.14159\n\n\nx", "Cafe\u0301 / Caf\u00e9",
                 "  two   spaces\r\nline"]:
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False), text
    forget_gguf_files()


def test_tp_sizes_that_cannot_split_experts_or_heads_are_named(
        models: dict[str, Any]) -> None:
    """An expert's columns that do not divide by TP, and KV heads TP neither divides nor
    is a multiple of, are refused in one line naming the field and the valid sizes."""
    from phalanx.engine._errors import ModelConfigError

    moe = load_config(models["qwen3_moe"][0])    # 4 heads, 2 KV heads, experts of 32
    with pytest.raises(ModelConfigError, match=r"moe_intermediate_size=32 .* by 3"):
        ModelConfig.from_dict(_raw(models["qwen3_moe"][0]) | {
            "num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96,
            "head_dim": 16}).check_tp(3)
    assert moe.valid_tp_sizes() == [1, 2, 4]
    gemma = load_config(models["gemma3-kv1"][0])   # one KV head: replicated at any TP
    assert gemma.valid_tp_sizes() == [1, 2, 4]
    with pytest.raises(ModelConfigError, match="num_key_value_heads=2 neither divides"):
        ModelConfig.from_dict(_raw(models["mixtral"][0]) | {
            "num_attention_heads": 6, "hidden_size": 96, "intermediate_size": 96}).check_tp(3)


def _raw(path: Path) -> dict[str, Any]:
    import json

    return dict(json.loads((path / "config.json").read_text()))


def test_quantized_experts_stay_quantized(ggufs: dict[str, Path], tmp_path: Path) -> None:
    """Mixtral requantized to Q8_0 by llama-quantize: every expert's projections keep
    their blocks (the int4/planes kernels), the rank holds less than the dense model,
    and the first greedy token of each prompt is the float32 model's."""
    import subprocess

    from phalanx_bench.llamacpp_build import quantize_path

    tool = quantize_path()
    if not tool.exists():
        pytest.skip(f"no llama-quantize at {tool}: bench/setup_llamacpp.sh builds it")
    q8 = tmp_path / "mixtral-q8_0.gguf"
    subprocess.run([str(tool), str(ggufs["mixtral"]), str(q8), "Q8_0"], check=True,
                   capture_output=True, timeout=120)
    dense = Runner(ggufs["mixtral"], num_pages=PAGES, page_tokens=PAGE_TOKENS, threads=1)
    runner = Runner(q8, num_pages=PAGES, page_tokens=PAGE_TOKENS, threads=1)
    try:
        experts = [e for layer in runner.model.layers for e in layer.mlp.experts]
        assert experts and all(e.gate_up_proj.qmms is not None and
                               e.down_proj.qmms is not None for e in experts)
        assert runner.memory().weight_bytes < dense.memory().weight_bytes / 2
        first = [t[0] for t in engine_generate_batch(runner, BATCH, new_tokens=1)]
        assert first == [t[0] for t in engine_generate_batch(dense, BATCH, new_tokens=1)]
    finally:
        runner.close()
        dense.close()
        forget_gguf_files()


def test_the_engines_prefix_cache_on_sliding_layers_equals_recomputed(
        models: dict[str, Any]) -> None:
    """Through the engine (two ranks, Gemma 3's one KV head replicated): a repeated
    prompt past the window takes its pages from the memory tier and continues with
    transformers' tokens, as the first, recomputed one did."""
    from engine_oracle import greedy
    from phalanx.engine.llm import LLM

    path, ref = models["gemma3-kv1"]
    with LLM(model=str(path), tensor_parallel_size=2, page_tokens=PAGE_TOKENS,
             num_pages=PAGES) as llm:
        prompt = {"prompt_token_ids": BATCH[1]}
        first = llm.generate([prompt], greedy(32))[0].outputs[0].token_ids
        second = llm.generate([prompt], greedy(32))[0].outputs[0].token_ids
        hit = llm.counters.prompt_memory
    assert list(first) == list(second) == ref[1]
    assert hit >= 32   # two full pages of the 37-token prompt came from the cache
