"""Tensor parallelism with real rank processes, against Hugging Face transformers.

Each case writes a tiny checkpoint with transformers, runs the engine at TP 2 or 3 over
a phalanx shared-memory domain (or torch.distributed gloo), each rank reading only its
slices, and compares: float32 logits within ``ATOL`` (1e-4), greedy generation of 32
tokens identical to ``model.generate``. One Worker of 3 ranks serves the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import phalanx
from engine_oracle import (
    ATOL,
    PAGE_TOKENS,
    PROMPT,
    engine_generate,
    hf_reference,
    write_checkpoint,
)
from phalanx.engine.model.config import load_config
from phalanx.engine.model.transformer import CausalLM
from phalanx.engine.worker.runner import Runner

CASES: dict[str, tuple[str, int, dict[str, Any]]] = {
    # name: (arch, tp, config overrides)
    "llama-tp2-kv-split": ("llama", 2, {}),
    "qwen2-tp2-tied": ("qwen2", 2, dict(tie_word_embeddings=True)),
    "llama-tp2-kv-replicated": ("llama", 2, dict(num_key_value_heads=1)),
    "llama-tp3-kv-split": ("llama", 3, dict(hidden_size=96, intermediate_size=192,
                                             num_attention_heads=6, num_key_value_heads=3)),
    "mistral-tp3-kv-replicated": ("mistral", 3, dict(
        hidden_size=96, intermediate_size=192, num_attention_heads=6, num_key_value_heads=1,
        tie_word_embeddings=True)),
}


@pytest.fixture(scope="module")
def worker() -> Iterator[phalanx.Worker]:
    with phalanx.Worker(ranks=3, task_timeout=240) as w:
        yield w


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory
                ) -> dict[str, tuple[Path, torch.Tensor, list[int]]]:
    root = tmp_path_factory.mktemp("tp-ckpt")
    out = {}
    for i, (name, (arch, _, kw)) in enumerate(CASES.items()):
        path = write_checkpoint(root / name, arch, seed=10 + i, **kw)
        out[name] = (path, *hf_reference(path))
    return out


def _rank_generate(d: Any, path: Path, vocab_parallel: bool) -> dict[str, Any]:
    from phalanx.engine.worker.tp import DomainComm

    runner = Runner(path, DomainComm(d), num_pages=8, page_tokens=PAGE_TOKENS,
                    vocab_parallel=vocab_parallel)
    try:
        logits, tokens = engine_generate(runner)
        return {"logits": logits, "tokens": tokens, "memory": runner.memory(),
                "report": runner.report.to_dict()}
    finally:
        runner.close()


def _run_domain(worker: phalanx.Worker, tp: int, path: Path,
                vocab_parallel: bool = False) -> list[dict[str, Any]]:
    def orch(o: Any) -> list[dict[str, Any]]:
        d = o.allocate_domain("tp", ranks=list(range(tp)), window_size=256 << 10)
        futures = [o.submit(r, _rank_generate, d, path, vocab_parallel) for r in range(tp)]
        out = [f.result() for f in futures]
        o.release_domain(d)
        return out
    return list(worker.run(orch))


def _replicated_bytes(path: Path) -> int:
    """Bytes every rank holds whole: embedding (+ untied LM head) and the norms."""
    cfg = load_config(path)
    heads = 1 if cfg.tie_word_embeddings else 2
    return 4 * (heads * cfg.vocab_size * cfg.hidden_size
                + (2 * cfg.num_layers + 1) * cfg.hidden_size)


@pytest.mark.parametrize("case", list(CASES))
def test_oracle_tp(worker: phalanx.Worker, checkpoints: dict[str, Any], case: str) -> None:
    path, ref_logits, ref_tokens = checkpoints[case]
    tp = CASES[case][1]
    results = _run_domain(worker, tp, path)
    for r, res in enumerate(results):
        err = (res["logits"] - ref_logits).abs().max().item()
        assert err <= ATOL, f"{case} rank {r}: logits differ by {err}"
        assert res["tokens"] == ref_tokens, f"{case} rank {r}"
        assert res["report"]["missing"] == [] and res["report"]["unexpected"] == []
        # every rank read exactly what it holds, never the whole model
        assert res["memory"].weight_bytes == res["memory"].bytes_read
    # the ranks' logits are bit-identical: sums are taken in the same order everywhere
    assert all(torch.equal(res["logits"], results[0]["logits"]) for res in results)
    full = CausalLM.from_pretrained(path, load_config(path))[0].weight_bytes()
    rep = _replicated_bytes(path)
    per_rank = [res["memory"].weight_bytes for res in results]
    if "kv-split" in case or case.startswith("qwen2"):
        assert per_rank == [rep + (full - rep) // tp] * tp, (per_rank, full, rep)
    else:  # the replicated KV head's k/v rows are held by several ranks
        assert all(rep + (full - rep) // tp < b < full for b in per_rank), (per_rank, full)


def test_vocab_parallel_tp2(worker: phalanx.Worker, checkpoints: dict[str, Any]) -> None:
    path, ref_logits, ref_tokens = checkpoints["llama-tp2-kv-split"]
    results = _run_domain(worker, 2, path, vocab_parallel=True)
    full = CausalLM.from_pretrained(path, load_config(path))[0].weight_bytes()
    for res in results:
        assert (res["logits"] - ref_logits).abs().max().item() <= ATOL
        assert res["tokens"] == ref_tokens
        assert res["memory"].weight_bytes * 2 < full + 4096  # about half of everything


def _rank_gloo(store_path: str, rank: int, size: int, path: Path) -> dict[str, Any]:
    import torch.distributed as dist

    from phalanx.engine.worker.tp import TorchDistComm

    store = dist.FileStore(store_path, size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    try:
        out = {}
        for vocab_parallel in (False, True):   # the second all-gathers the logits
            runner = Runner(path, TorchDistComm(dist.group.WORLD), num_pages=8,
                            page_tokens=PAGE_TOKENS, vocab_parallel=vocab_parallel)
            out[vocab_parallel] = engine_generate(runner)
            runner.close()
        return out
    finally:
        dist.destroy_process_group()


def test_oracle_tp2_over_gloo(worker: phalanx.Worker, checkpoints: dict[str, Any],
                              tmp_path: Path) -> None:
    path, ref_logits, ref_tokens = checkpoints["qwen2-tp2-tied"]
    store = str(tmp_path / "gloo-store")

    def orch(o: Any) -> list[dict[str, Any]]:
        futures = [o.submit(r, _rank_gloo, store, r, 2, path) for r in range(2)]
        return [f.result() for f in futures]

    for res in worker.run(orch):
        for logits, tokens in res.values():
            assert (logits - ref_logits).abs().max().item() <= ATOL
            assert tokens == ref_tokens


def _rank_collectives(d: Any) -> dict[str, Any]:
    from phalanx.engine.worker.tp import DomainComm

    comm = DomainComm(d)
    big = torch.full((100_000,), float(comm.rank + 1))        # more than one round
    comm.all_reduce(big)
    gathered = comm.all_gather(torch.tensor([[comm.rank, 10 + comm.rank]]))
    payload = bytes(range(256)) * 700 if comm.rank == 0 else None   # 179,200 bytes
    got = comm.broadcast_bytes(payload)
    empty = comm.broadcast_bytes(b"" if comm.rank == 0 else None)
    half = comm.all_reduce(torch.ones(7, dtype=torch.bfloat16))
    return {"sum": big.unique().tolist(), "gathered": gathered.tolist(),
            "bytes_ok": got == bytes(range(256)) * 700, "empty": empty,
            "bf16": half.float().tolist()}


def test_domain_collectives(worker: phalanx.Worker) -> None:
    def orch(o: Any) -> list[dict[str, Any]]:
        d = o.allocate_domain("tpc", ranks=[0, 1, 2], window_size=64 << 10)
        out = [f.result() for f in [o.submit(r, _rank_collectives, d) for r in range(3)]]
        o.release_domain(d)
        return out

    for res in worker.run(orch):
        assert res["sum"] == [6.0]
        assert res["gathered"] == [[0, 10], [1, 11], [2, 12]]
        assert res["bytes_ok"] and res["empty"] == b""
        assert res["bf16"] == [3.0] * 7


_FINGERPRINT = b"engine-tp-test-model"


def _rank_stage_prompt(d: Any, path: Path, keys: list[bytes]) -> Any:
    from phalanx.engine.core.plan import PageSave, SamplingSpec, SeqChunk, StepPlan
    from phalanx.engine.disk.staging import attach_staging
    from phalanx.engine.worker.tp import DomainComm

    runner = Runner(path, DomainComm(d), num_pages=8, page_tokens=PAGE_TOKENS)
    attach_staging(runner)
    plan = StepPlan(0, [SeqChunk(1, PROMPT, 0, [0, 1, 2], False, SamplingSpec())],
                    saves=[PageSave(keys, list(range(len(keys))))])
    runner.execute(plan)
    geometry = runner.geometry()
    runner.close()
    return geometry


def _rank_generate_cached(d: Any, path: Path, keys: list[bytes]) -> dict[str, Any]:
    from phalanx.engine.core.plan import PageLoad
    from phalanx.engine.disk.staging import attach_staging
    from phalanx.engine.worker.tp import DomainComm

    runner = Runner(path, DomainComm(d), num_pages=8, page_tokens=PAGE_TOKENS)
    attach_staging(runner)
    cached = len(keys) * PAGE_TOKENS
    # the prefix lands in other pages than it was computed in: pages 3 and 4
    logits, tokens = engine_generate(runner, first_page=3, cached=cached,
                                     loads=[PageLoad(keys, [3, 4])])
    runner.close()
    return {"logits": logits, "tokens": tokens}


def _rank_close_staging() -> None:
    from phalanx.runtime import rank_services

    rank_services().close("engine.staging")


def test_disk_tier_after_restart_equals_recomputed(
        worker: phalanx.Worker, checkpoints: dict[str, Any], tmp_path: Path) -> None:
    """Every rank stages its shard of a prompt's full pages, the replicated cache stores
    them, the cache and the stagings are closed (a restart), the cache is recovered and
    loads them into other pages: the continuation equals the recomputed one."""
    from phalanx.engine.disk.staging import staging_source
    from phalanx.kvstore.keys import fingerprint_digest, page_keys
    from phalanx.replication import ReplicatedCache

    path, ref_logits, ref_tokens = checkpoints["llama-tp3-kv-split"]
    keys = page_keys(PROMPT, PAGE_TOKENS, fingerprint_digest(_FINGERPRINT))
    assert len(keys) == 2

    def stage(o: Any) -> list[Any]:
        d = o.allocate_domain("tp", ranks=[0, 1, 2], window_size=256 << 10)
        out = [f.result() for f in [o.submit(r, _rank_stage_prompt, d, path, keys)
                                    for r in range(3)]]
        o.release_domain(d)
        return out

    geometry = worker.run(stage)[0]
    opts = dict(geometry=geometry, fingerprint=_FINGERPRINT, capacity_bytes=1 << 26,
                kv_source_factory=staging_source)
    cache = ReplicatedCache.open(worker, tmp_path / "cache", **opts)
    cache.store(PROMPT)
    cache.close()
    worker.run(lambda o: [f.result() for f in [o.submit(r, _rank_close_staging)
                                               for r in range(3)]])

    cache = ReplicatedCache.open(worker, tmp_path / "cache", **opts)
    try:
        assert cache.lookup(PROMPT) == 2
        cache.load(PROMPT, 2)

        def generate(o: Any) -> list[dict[str, Any]]:
            d = o.allocate_domain("tp", ranks=[0, 1, 2], window_size=256 << 10)
            out = [f.result() for f in [o.submit(r, _rank_generate_cached, d, path, keys)
                                        for r in range(3)]]
            o.release_domain(d)
            return out

        for res in worker.run(generate):
            cached = 2 * PAGE_TOKENS
            assert (res["logits"] - ref_logits[cached:]).abs().max().item() <= ATOL
            assert res["tokens"] == ref_tokens
        assert cache.check() == []
    finally:
        cache.close()
    worker.run(lambda o: [f.result() for f in [o.submit(r, _rank_close_staging)
                                               for r in range(3)]])


def _rank_open_runner(d: Any, path: Path) -> None:
    from phalanx.engine.worker.runner import open_runner
    from phalanx.engine.worker.tp import DomainComm

    runner = open_runner("outlives", path, DomainComm(d), num_pages=4,
                         page_tokens=PAGE_TOKENS)
    engine_generate(runner, new_tokens=2)


def _rank_use_runner() -> str:
    from phalanx.engine._errors import EngineError
    from phalanx.engine.worker.runner import close_runner, get_runner

    runner = get_runner("outlives")
    try:
        engine_generate(runner, new_tokens=2)
    except EngineError as exc:
        return str(exc)
    finally:
        close_runner("outlives")
    return "no error"


def test_a_runner_outliving_its_domain_does_not_block_its_release(
        worker: phalanx.Worker, checkpoints: dict[str, Any]) -> None:
    """The run ends with the runners still open (as when a step fails under it): the
    domain is released all the same (no window stays mapped by the runner) and the
    runner then refuses to run, naming the released domain."""
    path = checkpoints["llama-tp2-kv-split"][0]

    def open_and_leave(o: Any) -> None:
        d = o.allocate_domain("tp", ranks=[0, 1], window_size=256 << 10)
        for f in [o.submit(r, _rank_open_runner, d, path) for r in range(2)]:
            f.result()

    worker.run(open_and_leave)
    assert worker.live_domains == []
    errors = worker.run(lambda o: [f.result() for f in [o.submit(r, _rank_use_runner)
                                                        for r in range(2)]])
    assert all("TP domain 'tp' was released" in e for e in errors), errors
    assert worker.run(lambda o: 1) == 1  # not poisoned
