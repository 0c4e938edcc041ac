"""The decoder at TP 1 against Hugging Face transformers, and the config's refusals.

Tolerance: float32 logits within ``ATOL`` (1e-4) of transformers'; greedy generation of
32 tokens identical token for token to ``model.generate(do_sample=False)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_oracle import ATOL, PAGE_TOKENS, PROMPT, engine_generate, hf_reference, write_checkpoint
from phalanx.engine._errors import CheckpointError, ModelConfigError
from phalanx.engine.core.plan import SamplingSpec, SeqChunk, StepPlan
from phalanx.engine.model.checkpoint import Checkpoint, weights_digest
from phalanx.engine.model.config import ModelConfig, load_config
from phalanx.engine.worker.runner import Runner

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-untied-gqa": ("llama", {}),
    "llama-tied-mha-llama3": ("llama", dict(
        tie_word_embeddings=True, num_key_value_heads=4,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "qwen2-tied-bias": ("qwen2", dict(tie_word_embeddings=True)),
    "mistral-mqa-linear": ("mistral", dict(
        num_key_value_heads=1, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama-sharded": ("llama", dict(max_shard_size="100KB")),
    # windows of 8 under a 37-token prompt (issue 44): every layer, and Qwen2's from
    # max_window_layers on
    "mistral-sliding": ("mistral", dict(sliding_window=8)),
    "qwen2-sliding-from-layer-1": ("qwen2", dict(sliding_window=8, use_sliding_window=True,
                                                 max_window_layers=1)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for i, (name, (arch, kw)) in enumerate(CASES.items()):
        kw = dict(kw)
        shard = kw.pop("max_shard_size", None)
        out[name] = write_checkpoint(root / name, arch, seed=i, max_shard_size=shard, **kw)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_oracle_tp1(checkpoints: dict[str, Path], case: str) -> None:
    path = checkpoints[case]
    ref_logits, ref_tokens = hf_reference(path)
    runner = Runner(path, num_pages=8, page_tokens=PAGE_TOKENS, threads=1)
    assert runner.report.missing == [] and runner.report.unexpected == []
    logits, tokens = engine_generate(runner)
    assert logits.shape == ref_logits.shape
    err = (logits - ref_logits).abs().max().item()
    assert err <= ATOL, f"{case}: logits differ by {err}"
    assert ref_logits.std().item() > 0.3  # spread out: greedy is not decided by ties
    assert tokens == ref_tokens
    runner.close()


def test_sharded_checkpoint_has_an_index(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["llama-sharded"]
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("model-*.safetensors"))) > 1
    assert len(weights_digest(path)) == 64


def test_prefill_chunk_sizes_agree(checkpoints: dict[str, Path]) -> None:
    """Whole-prompt, page-sized and odd-sized chunks give the same logits (bounded:
    different matmul shapes may round differently) and the same greedy tokens."""
    runner = Runner(checkpoints["llama-untied-gqa"], num_pages=8, page_tokens=PAGE_TOKENS,
                    threads=1)
    base, base_tokens = engine_generate(runner, chunk=len(PROMPT))
    for chunk in (PAGE_TOKENS, 5, 1):
        logits, tokens = engine_generate(runner, chunk=chunk)
        assert (logits - base).abs().max().item() <= ATOL
        assert tokens == base_tokens


def test_batched_step_equals_single(checkpoints: dict[str, Path]) -> None:
    """Sequences batched in one step (a prefill beside decodes, then decodes of different
    context lengths, padded and masked) give each one's tokens alone."""
    runner = Runner(checkpoints["qwen2-tied-bias"], num_pages=16, page_tokens=PAGE_TOKENS,
                    threads=1)
    a, b = PROMPT, PROMPT[:20][::-1]
    _, alone_a = engine_generate(runner, prompt=a, new_tokens=6)
    _, alone_b = engine_generate(runner, prompt=b, new_tokens=5, first_page=8)
    greedy = SamplingSpec()
    pa, pb = [0, 1, 2], [3, 4]
    r = runner.execute(StepPlan(0, [SeqChunk(1, a, 0, pa, True, greedy)]))
    ta, tb = [r.tokens[1]], []
    for step in range(1, 6):
        chunks = [SeqChunk(1, [ta[-1]], len(a) + step - 1, pa, True, greedy)]
        if step == 1:
            chunks.append(SeqChunk(2, b, 0, pb, True, greedy))
        else:
            chunks.insert(0, SeqChunk(2, [tb[-1]], len(b) + step - 2, pb, True, greedy))
        r = runner.execute(StepPlan(step, chunks))
        ta.append(r.tokens[1])
        tb.append(r.tokens[2])
    assert ta == alone_a and tb == alone_b
    # a chunk that does not sample returns no token
    assert 2 not in runner.execute(StepPlan(9, [SeqChunk(2, [1], len(b) + 5, pb, False,
                                                         greedy)])).tokens


def test_pages_round_trip(checkpoints: dict[str, Path]) -> None:
    """A sequence's pages read out and written into other pages (what a disk-tier save
    and load do) continue exactly as the originals."""
    runner = Runner(checkpoints["llama-untied-gqa"], num_pages=12, page_tokens=PAGE_TOKENS,
                    threads=1)
    _, tokens = engine_generate(runner, new_tokens=4)
    geom = runner.geometry()
    data = runner.read_pages([0, 1, 2])
    assert tuple(data.shape) == (3, geom.page_bytes)
    runner.write_pages([6, 7, 8], data)
    assert torch.equal(runner.read_pages([6, 7, 8]), data)
    pos = len(PROMPT) + len(tokens) - 1
    nexts = [runner.execute(StepPlan(9, [SeqChunk(1, [tokens[-1]], pos, table, True,
                                                  SamplingSpec())])).tokens[1]
             for table in ([0, 1, 2], [6, 7, 8])]
    assert nexts[0] == nexts[1]
    mem = runner.memory()
    assert mem.weight_bytes == mem.bytes_read


def _raw(path: Path) -> dict[str, Any]:
    return dict(json.loads((path / "config.json").read_text()))


@pytest.mark.parametrize(("edit", "field", "value"), [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures", "GPT2LMHeadModel"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
     "original_max_position_embeddings", "None"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0],
                          "long_factor": [1.0], "original_max_position_embeddings": 64}},
     "short_factor", "[1.0]"),
    ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope_type", "dynamic"),
    ({"hidden_act": "gelu"}, "hidden_act", "gelu"),
    ({"num_key_value_heads": 3}, "num_key_value_heads", "3"),
    ({"dtype": "int8"}, "dtype", "int8"),
])
def test_refusals_name_field_and_value(checkpoints: dict[str, Path], edit: dict[str, Any],
                                       field: str, value: str) -> None:
    raw = _raw(checkpoints["llama-untied-gqa"]) | edit
    with pytest.raises(ModelConfigError) as info:
        ModelConfig.from_dict(raw)
    assert field in str(info.value) and value in str(info.value)


def test_sliding_windows_are_read_per_family(checkpoints: dict[str, Path]) -> None:
    """A window shorter than the context is honoured (masked; issue 44), on the layers the
    family's config puts it on."""
    raw = _raw(checkpoints["mistral-mqa-linear"]) | {"sliding_window": 64}
    cfg = ModelConfig.from_dict(raw)
    assert cfg.sliding_window == 64 and cfg.layer_sliding == (True, True)
    # Qwen2's window applies only with use_sliding_window, from max_window_layers on
    qwen = _raw(checkpoints["qwen2-tied-bias"]) | {"sliding_window": 16, "layer_types": None}
    assert ModelConfig.from_dict(qwen).sliding_window is None
    on = ModelConfig.from_dict(qwen | {"use_sliding_window": True, "max_window_layers": 1})
    assert on.sliding_window == 16 and on.layer_sliding == (False, True)
    with pytest.raises(ModelConfigError, match="sliding_window=0"):
        ModelConfig.from_dict(raw | {"sliding_window": 0})


def test_rope_fields_of_both_transformers_versions(checkpoints: dict[str, Path]) -> None:
    raw = _raw(checkpoints["mistral-mqa-linear"])
    new = ModelConfig.from_dict(raw)
    old = dict(raw)
    params = old.pop("rope_parameters")
    old["rope_theta"] = params.pop("rope_theta")
    old["rope_scaling"] = {"type": params["rope_type"], "factor": params["factor"]}
    assert ModelConfig.from_dict(old) == new
    assert new.rope_scaling is not None and new.rope_scaling.factor == 2.0


def test_missing_tensor_is_named(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    src = checkpoints["llama-untied-gqa"]
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    tensors["extra.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with Checkpoint(tmp_path) as ckpt:
        assert "extra.weight" in ckpt.names()
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        Runner(tmp_path, num_pages=2, page_tokens=PAGE_TOKENS, threads=1)
    assert load_config(tmp_path).num_layers == 2


def test_rotary_tables_grow_on_demand(checkpoints: dict[str, Path]) -> None:
    """A long-context config tables only the positions used; grown rows equal the rows a
    full table would hold (llama3 scaling included)."""
    from phalanx.engine.model.rope import Rotary, rope_inv_freq

    raw = _raw(checkpoints["llama-tied-mha-llama3"]) | {"max_position_embeddings": 100_000}
    cfg = ModelConfig.from_dict(raw)
    rot = Rotary(cfg.rope_theta, cfg.rope_scaling, cfg.head_dim, cfg.max_model_len,
                 torch.float32)
    assert rot.cos.shape[0] == 4096
    rot.ensure(9000)
    assert 9000 <= rot.cos.shape[0] <= 100_000
    pos = torch.tensor([0.0, 4095.0, 8999.0])
    freqs = pos[:, None] * rope_inv_freq(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling)[0][None, :]
    want = torch.cat((freqs, freqs), dim=-1)
    assert torch.equal(rot.cos[[0, 4095, 8999]], want.cos())
    assert torch.equal(rot.sin[[0, 4095, 8999]], want.sin())


def test_runner_refuses_bad_plans_by_name(checkpoints: dict[str, Path]) -> None:
    from phalanx.engine._errors import EngineError

    runner = Runner(checkpoints["llama-untied-gqa"], num_pages=4, page_tokens=PAGE_TOKENS,
                    threads=1)
    g = SamplingSpec()
    bad = [
        (SeqChunk(7, [1, 999_999], 0, [0], True, g), "token ids \\[999999\\]"),
        (SeqChunk(7, list(range(20)), 0, [0], True, g), "needs 2 pages"),
        (SeqChunk(7, [1], 0, [9], True, g), "page ids \\[9\\]"),
        (SeqChunk(7, [1], 500, list(range(4)), True, g), "position 500 is beyond max_model_len"),
    ]
    for chunk, match in bad:
        with pytest.raises(EngineError, match=match):
            runner.execute(StepPlan(0, [chunk]))
    runner.close()
    with pytest.raises(EngineError, match="closed"):
        runner.execute(StepPlan(1, [SeqChunk(7, [1], 0, [0], True, g)]))


def test_a_config_that_does_not_fit_the_tensors_is_refused(checkpoints: dict[str, Path],
                                                         tmp_path: Path) -> None:
    """A smaller intermediate_size would read fitting slices of larger tensors: a silently
    wrong model. The whole tensor's shape is checked against the config."""
    import shutil

    src = checkpoints["llama-untied-gqa"]
    shutil.copytree(src, tmp_path / "m")
    raw = _raw(src) | {"intermediate_size": 64}
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight has shape \[128, 64\]"):
        Runner(tmp_path / "m", num_pages=2, page_tokens=PAGE_TOKENS, threads=1)


def test_kept_decode_gathers_give_the_fresh_gathers_logprobs(
        checkpoints: dict[str, Path]) -> None:
    """Decode rows that keep their gathered K/V from step to step (the same rows on the
    same pages: only the new position is written) give bit for bit what gathering
    afresh every step gives, through page growth, a row leaving and a new sequence
    joining on the freed pages."""
    path = checkpoints["llama-untied-gqa"]
    kept = Runner(path, num_pages=16, page_tokens=PAGE_TOKENS, threads=1)
    fresh = Runner(path, num_pages=16, page_tokens=PAGE_TOKENS, threads=1,
                   decode_gather_bytes=0)
    spec = SamplingSpec(logprobs=3)
    a, b, c = PROMPT, PROMPT[:20][::-1], PROMPT[4:30]
    tables = {1: [0, 1, 2, 3, 4], 2: [5, 6, 7, 8], 3: [0, 1, 2, 3, 4]}   # 3 reuses 1's pages
    lengths: dict[int, int] = {}
    last: dict[int, int] = {}
    step = 0

    def run(chunks: list[SeqChunk]) -> None:
        nonlocal step
        plan = StepPlan(step, chunks)
        step += 1
        got, want = kept.execute(plan), fresh.execute(plan)
        assert got.tokens == want.tokens and got.logprobs == want.logprobs, plan.step
        for ch in chunks:
            lengths[ch.seq_id] = ch.start_pos + len(ch.tokens)
            last[ch.seq_id] = got.tokens[ch.seq_id]

    def decode(seq: int) -> SeqChunk:
        n = lengths[seq]
        return SeqChunk(seq, [last[seq]], n, tables[seq][: n // PAGE_TOKENS + 1], True, spec)

    def prefill(seq: int, prompt: list[int]) -> SeqChunk:
        return SeqChunk(seq, prompt, 0, tables[seq][: -(-len(prompt) // PAGE_TOKENS)],
                        True, spec)

    run([prefill(1, a), prefill(2, b)])
    for _ in range(30):                      # 1 crosses into its 4th and 5th page, 2 its 3rd
        run([decode(1), decode(2)])
    reused = kept.decode_gather.steps_reused
    assert reused > 20 and fresh.decode_gather.steps_reused == 0
    run([decode(2), prefill(3, c)])           # 1 has left; 3 prefills on its pages
    for _ in range(12):
        run([decode(3), decode(2)])
    assert kept.decode_gather.steps_reused > reused + 8
