"""The engine's disk tier when a rank cannot read its shard: a miss, never a dead engine.

A step's ``PageLoad`` is read by every rank from its own store. When the read fails on
one rank (a record missing or corrupt there, an I/O error), the ranks agree on it before
the forward, no rank runs the step, and the scheduler recomputes what was to be loaded
(docs/design.md, engine: disk tier). Two levels: the scheduler's undo with fake ranks
(exact pages, keys and counters), and a TP-2 engine whose rank 1 fails its reads through
the store's own failpoint (``cache.load.pinned``, armed to fail with EIO).
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path
from typing import Any

import pytest

from engine_oracle import greedy, write_checkpoint
from phalanx.engine.core.plan import StepPlan, StepResult
from phalanx.engine.core.scheduler import Scheduler, SchedulerConfig
from phalanx.engine.core.sequence import Seq, SeqStatus
from phalanx.engine.llm import LLM
from phalanx.kvstore.keys import page_keys
from test_engine_scheduler import FP, FakeRanks, drain, reference
from tiers import InMemoryTier

PT = 16


class FailingLoads(FakeRanks):
    """Fake ranks whose next step with loads fails on "rank 1": the loaded pages get
    garbage (what a rank that read half a record holds) and the step runs nowhere."""

    fail = True

    def execute(self, plan: StepPlan) -> StepResult:
        if not (self.fail and plan.loads):
            return super().execute(plan)
        self.fail = False
        self.plans.append(plan)
        for ld in plan.loads:
            for p in ld.page_ids:
                self.pages[p] = [-7] * self.pt
        return StepResult(step=plan.step, tokens={}, load_failures={1: "OSError: EIO"})


def test_a_failed_load_is_undone_and_recomputed_by_the_scheduler() -> None:
    prompt = list(range(30, 43))                                  # 3 full pages + 1
    keys = page_keys(prompt, 4, FP)
    disk = {k: prompt[i * 4 : (i + 1) * 4] for i, k in enumerate(keys)}
    tier = InMemoryTier(keys)
    sched = Scheduler(SchedulerConfig(num_pages=16, page_tokens=4), FP, tier)
    ranks = FailingLoads(sched, disk)
    decoding = Seq(list(range(200, 206)), greedy(6), seq_id=9)
    sched.add(decoding)
    first, _ = sched.schedule()
    assert first is not None and sched.update(ranks.execute(first))
    # a loads the prefix, b shares it as a memory hit in the same step
    a = Seq([*prompt[:12], 1], greedy(2), seq_id=1)
    b = Seq([*prompt[:12], 2], greedy(2), seq_id=2)
    sched.add(a)
    sched.add(b)
    plan, _ = sched.schedule()
    assert plan is not None and len(plan.loads) == 1
    loaded = list(plan.loads[0].page_ids)
    before = (decoding.num_computed, list(decoding.block_table))
    assert sched.update(ranks.execute(plan)) == []
    # the step did not happen: nothing advanced, the loaded pages are no hits, the
    # decode holds only what it held, the admitted requests hold nothing loaded
    assert (decoding.num_computed, decoding.block_table) == before
    assert all(sched.pool.key[p] is None for p in loaded)
    assert sched.pool.match(keys) == []
    assert (a.status, b.status) == (SeqStatus.RUNNING, SeqStatus.RUNNING)
    assert (a.num_computed, a.block_table, b.num_computed, b.block_table) == (0, [], 0, [])
    assert tier.pins == {}
    assert (a.cached_disk, b.cached_memory) == (0, 0)
    c = sched.pool.counters
    assert (c.prompt_memory, c.prompt_disk, c.prompt_computed) == (0, 0, 6 + 13 + 13)
    drain(sched, ranks)
    assert tier.pins == {}
    assert all(p.loads == [] for p in ranks.plans[2:])            # no second lookup
    assert a.output_tokens == reference(a.prompt_tokens, 2)
    assert b.output_tokens == reference(b.prompt_tokens, 2)
    assert decoding.output_tokens == reference(decoding.prompt_tokens, 6)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("disk") / "llama", "llama", seed=3,
                            max_position_embeddings=256)


def _prompts() -> list[dict[str, Any]]:
    system = [(7 * i + 3) % 250 + 3 for i in range(3 * PT)]      # three pages, shared
    return [{"prompt_token_ids": [*system, 5 + i, 9 + 2 * i]} for i in range(2)]


def _tokens(outs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_a_load_failing_on_one_rank_is_a_miss(model_dir: Path, tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    prompts, sp = _prompts(), greedy(6)
    with LLM(model_dir, tensor_parallel_size=2, page_tokens=PT, num_pages=64,
             max_num_batched_tokens=256, prefix_cache_disk=tmp_path / "cache") as llm:
        engine = llm.engine
        tier = engine.disk_tier
        assert tier is not None
        computed = llm.generate(prompts, sp)                      # fills the disk tier
        assert all(o.cached_tokens_disk == 0 for o in computed)
        assert tier.drain(60) and tier.stats.stores > 0
        ref = _tokens(computed)
        assert llm.reset_prefix_cache()                           # memory tier dropped

        worker = engine.executor.worker
        worker.arm_failpoint("cache.load.pinned", f"errno:{errno.EIO}", ranks=[1])
        with caplog.at_level(logging.WARNING, logger="phalanx.engine"):
            failed = llm.generate(prompts, sp)
        worker.disarm_failpoints()
        assert _tokens(failed) == ref                             # recomputed
        assert all(o.cached_tokens_disk == 0 and o.outputs[0].finish_reason == "length"
                   for o in failed)
        assert engine.dead is None and engine.stats().as_metrics()["disk_tier_load_failures"] == 1
        assert tier.stats.load_failures == 1
        (line,) = [r.getMessage() for r in caplog.records if "failed on rank" in r.getMessage()]
        key = page_keys(prompts[0]["prompt_token_ids"], PT, engine.fingerprint)[2]
        for part in ("rank 1", key.hex(), "rank-1", f"errno {errno.EIO} (EIO)"):
            assert part in line, (part, line)
        assert engine.disk_tier.cache.stats()[0]["leases"] == 0       # released after all

        assert llm.reset_prefix_cache()
        again = llm.generate(prompts, sp)                         # a disk hit again
        assert _tokens(again) == ref
        # the first loads the shared pages, the second finds them in memory
        assert [(o.cached_tokens_disk, o.cached_tokens_memory) for o in again] == [
            (3 * PT, 0), (0, 3 * PT)]
        assert tier.stats.load_failures == 1


def test_a_miss_asks_rank_0_nothing_and_a_hit_still_finds_its_pages(
        model_dir: Path, tmp_path: Path) -> None:
    """The tier answers a miss from the page keys rank 0 holds (docs/design.md, engine:
    disk tier): no lookup on rank 0 for a prompt no disk has, one for a prompt whose
    pages were stored in this process or recovered after a restart."""
    prompts, sp = _prompts(), greedy(4)
    kw: dict[str, Any] = dict(tensor_parallel_size=2, page_tokens=PT, num_pages=64,
                              max_num_batched_tokens=256,
                              prefix_cache_disk=tmp_path / "cache")
    with LLM(model_dir, **kw) as llm:
        tier = llm.engine.disk_tier
        assert tier is not None
        computed = llm.generate(prompts[:1], sp)
        stats = llm.engine.stats().as_metrics()
        assert (stats["disk_tier_lookups"], stats["disk_tier_lookups_skipped"]) == (0, 1)
        assert tier.drain(60) and tier.stats.stores > 0
        assert llm.reset_prefix_cache()
        # the second prompt shares the first's three pages: known from its store
        (hit,) = llm.generate(prompts[1:], sp)
        assert hit.cached_tokens_disk == 3 * PT
        assert llm.engine.stats().as_metrics()["disk_tier_lookups"] == 1
        assert tier.drain(60)
    with LLM(model_dir, **kw) as llm:                             # recovered from disk
        (again,) = llm.generate(prompts[:1], sp)
        assert again.cached_tokens_disk == 3 * PT
        assert _tokens([again]) == _tokens(computed)
        fresh = llm.generate({"prompt_token_ids": [200 + i for i in range(2 * PT)]}, sp)
        assert fresh[0].cached_tokens_disk == 0
        stats = llm.engine.stats().as_metrics()
        assert (stats["disk_tier_lookups"], stats["disk_tier_lookups_skipped"]) == (1, 1)
