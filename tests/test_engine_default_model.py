"""The embedded default model: pinned bytes, loaded by the same loader, equal to what
transformers computes on it; its tokenizer against transformers'; ``phalanx model init``."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from engine_oracle import engine_generate
from phalanx.engine.model.default_model import (
    DEFAULT_SPEC,
    ModelSpec,
    default_model_dir,
    ensure_default_model,
)
from phalanx.engine.model.tokenizer import Tokenizer
from phalanx.engine.worker.runner import Runner
from phalanx.serve.cli import cli

# sha256 of every file of the default model. A change here changes every cached
# prefix's fingerprint and every user's model: bump default_model.FORMAT with it.
DIGESTS = {
    "config.json": "5b717578af663126d63589ae90b5ce7b9afc49d93c2ed9fcf8ce6d415255c398",
    "generation_config.json": "83ef5066f4993adc3cf6d8d604d9d1349a6ccc0ed9e0d6b48c70a1dd393459a6",
    "model.safetensors": "93fe873e6a56d5d34257c1a28c5768ec30f35d45e7ed898fbcf96ff441c63370",
    "tokenizer.json": "e445c5fc58b45d17d3eceeec4230eb2c989340713d397273aa1bf2729b374276",
    "tokenizer_config.json": "606235687bfec1158d632d1a4e6dfc4b56b68dfc548d269aecfadfb502374857",
}
TEXTS = ["Hello! Tell me a story about a robot.", "  two  spaces\tand a tab\n",
         "numbers 12345 and code: x = [1, 2, 3]", "unicode: café, naïve, 東京 🚀", ""]


@pytest.fixture(scope="module", autouse=True)
def _no_progress_bars() -> None:
    import transformers

    # tqdm's monitor thread would outlive the tests
    transformers.utils.logging.disable_progress_bar()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return default_model_dir(tmp_path_factory.mktemp("cache"))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_default_model_bytes_are_pinned(model_dir: Path) -> None:
    assert model_dir.name == f"{DEFAULT_SPEC.name}-{DEFAULT_SPEC.digest()}"
    assert {p.name: _sha(p) for p in model_dir.iterdir()} == DIGESTS
    assert stat.S_IMODE(model_dir.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in model_dir.iterdir())
    # later uses find it and write nothing; no temporary directory is left beside it
    inode = (model_dir / "model.safetensors").stat().st_ino
    assert default_model_dir(model_dir.parent) == model_dir
    assert (model_dir / "model.safetensors").stat().st_ino == inode
    assert [p.name for p in model_dir.parent.iterdir()] == [model_dir.name]


def test_default_model_uses_the_xdg_cache(tmp_path: Path, model_dir: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = default_model_dir()
    assert path.parent == tmp_path / "phalanx" / "models"
    assert ensure_default_model() == path
    assert _sha(path / "model.safetensors") == DIGESTS["model.safetensors"]


def test_default_model_against_transformers(model_dir: Path) -> None:
    import transformers

    tok = Tokenizer(model_dir)
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Tell me a story"}]), add_special_tokens=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                           dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = hf(ids).logits[0]
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=24, min_new_tokens=24)[0, len(prompt):].tolist()
    runner = Runner(model_dir, num_pages=4, page_tokens=64, threads=1)
    logits, tokens = engine_generate(runner, prompt=prompt, new_tokens=24, chunk=64)
    assert (logits - ref).abs().max().item() <= 1e-4
    assert tokens == out
    assert len(set(tokens)) > 8  # greedy decoding is not stuck on one token
    runner.close()


def test_tokenizer_against_transformers(model_dir: Path) -> None:
    import transformers

    ours = Tokenizer(model_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True) == text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Why?"}]
    for gen in (True, False):
        assert ours.apply_chat_template(chat, add_generation_prompt=gen) == \
            theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    im_end = ours.encode("<|im_end|>")
    assert len(im_end) == 1 and im_end[0] in ours.eos_token_ids
    assert ours.decode(im_end) == "" and ours.decode(im_end, skip_special_tokens=False) == \
        "<|im_end|>"
    assert ours.vocab_size == DEFAULT_SPEC.vocab


def test_model_init_writes_a_chosen_size(tmp_path: Path) -> None:
    flags = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "1",
             "--vocab", "512", "--arch", "qwen2", "--dtype", "bfloat16", "--seed", "3"]
    res = [CliRunner().invoke(cli, ["model", "init", str(tmp_path / d), *flags])
           for d in ("a", "b")]
    assert all(r.exit_code == 0 for r in res), res[0].output
    info = json.loads(res[0].output)
    assert info["spec"]["intermediate"] == 176
    a, b = tmp_path / "a", tmp_path / "b"
    assert {p.name: _sha(p) for p in a.iterdir()} == {p.name: _sha(p) for p in b.iterdir()}
    cfg = json.loads((a / "config.json").read_text())
    assert (cfg["architectures"], cfg["dtype"], cfg["vocab_size"]) == (
        ["Qwen2ForCausalLM"], "bfloat16", 512)
    runner = Runner(a, num_pages=2, page_tokens=64, threads=1)
    assert runner.model.embed_tokens.weight.dtype == torch.bfloat16
    assert runner.report.missing == [] and runner.report.unexpected == []
    _, tokens = engine_generate(runner, prompt=list(range(10, 40)), new_tokens=4, chunk=64)
    assert len(tokens) == 4 and all(0 <= t < 512 for t in tokens)
    again = CliRunner().invoke(cli, ["model", "init", str(a), *flags])
    assert again.exit_code != 0 and "already exists" in again.output
    bad = CliRunner().invoke(cli, ["model", "init", str(tmp_path / "c"), "--heads", "5"])
    assert bad.exit_code != 0 and "hidden=256" in bad.output
    assert not (tmp_path / "c").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_logits_are_bounded(tmp_path: Path, dtype: str) -> None:
    """16-bit weights and activations: the engine and transformers round at different
    points, so logits agree within a bound (10% of the largest logit), not bit for bit."""
    import transformers

    from phalanx.engine.model.default_model import write_model

    path = write_model(tmp_path / dtype, ModelSpec(layers=2, hidden=64, heads=4,
                                                    kv_heads=2, intermediate=128,
                                                    vocab=512, dtype=dtype))
    prompt = list(range(20, 60))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    runner = Runner(path, num_pages=2, page_tokens=64, threads=1)
    logits, _ = engine_generate(runner, prompt=prompt, new_tokens=1, chunk=64)
    err = (logits - ref).abs().max().item()
    assert err <= 0.1 * ref.abs().max().item(), err
    assert os.path.exists(path / "tokenizer.json")
