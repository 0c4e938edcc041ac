"""The scheduler with fake runner results: exact page ids, ref counts, eviction order,
preemption and recompute, chunking bounds, cancellation, the disk tier hook.

The fake ranks keep KV as tokens: each page holds the tokens written into its slots, and
the "model" samples a deterministic function of every token it reads back through the
block table. A wrong page id, a hit on the wrong prefix or a write into a shared page
therefore changes the output, which is compared with the single-request reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from phalanx.engine._errors import RequestError, SchedulerError
from phalanx.engine.core.plan import PageCopy, StepPlan, StepResult
from phalanx.engine.core.sampling import SamplingParams
from phalanx.engine.core.scheduler import Scheduler, SchedulerConfig
from phalanx.engine.core.sequence import FinishReason, Seq, SeqStatus
from phalanx.kvstore.keys import fingerprint_digest, page_keys
from tiers import InMemoryTier

FP = fingerprint_digest("fake-model")
VOCAB = 997


def next_token(seen: list[int]) -> int:
    acc = len(seen)
    for i, t in enumerate(seen):
        acc = (acc * 31 + (i + 1) * t) % 1_000_003
    return acc % VOCAB


def reference(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    out: list[int] = []
    for _ in range(n):
        t = next_token(toks)
        toks.append(t)
        out.append(t)
    return out


class FakeRanks:
    """Executes plans on pages of tokens; ``disk`` is the disk tier's records."""

    def __init__(self, sched: Scheduler, disk: dict[bytes, list[int]] | None = None) -> None:
        c = sched.config
        self.sched = sched
        self.pt = c.page_tokens
        self.pages = [[-1] * c.page_tokens for _ in range(c.num_pages)]
        self.disk = {} if disk is None else disk
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        pt, pool = self.pt, self.sched.pool
        for ld in plan.loads:
            for k, p in zip(ld.keys, ld.page_ids, strict=True):
                assert pool.key[p] in (None, k), f"load into page {p} cached for another key"
                self.pages[p] = list(self.disk[k])
        for c in plan.copies:   # after the loads, as a rank does them
            assert pool.key[c.dst] is None and pool.ref[c.dst] == 1, f"copy into {c.dst}"
            assert pool.ref[c.src] >= 1, f"copy from page {c.src}, which nothing holds"
            self.pages[c.dst] = list(self.pages[c.src])
        for ch in plan.chunks:
            assert len(ch.block_table) == -(-(ch.start_pos + len(ch.tokens)) // pt)
            for j, t in enumerate(ch.tokens):
                pos = ch.start_pos + j
                p = ch.block_table[pos // pt]
                assert pool.key[p] is None, f"write into cached (shared) page {p}"
                assert pool.ref[p] == 1, f"write into page {p} with {pool.ref[p]} holders"
                self.pages[p][pos % pt] = t
        toks: dict[int, int] = {}
        for ch in plan.chunks:
            if ch.sample:
                end = ch.start_pos + len(ch.tokens)
                seen = [self.pages[ch.block_table[q // pt]][q % pt] for q in range(end)]
                assert -1 not in seen
                toks[ch.seq_id] = next_token(seen)
        for sv in plan.saves:
            for k, p in zip(sv.keys, sv.page_ids, strict=True):
                self.disk[k] = list(self.pages[p])
        return StepResult(step=plan.step, tokens=toks)


def step(sched: Scheduler, ranks: FakeRanks) -> StepPlan | None:
    plan, _ = sched.schedule()
    if plan is None:
        return None
    for s in sched.update(ranks.execute(plan)):
        mt = s.seq.params.max_tokens
        if mt is not None and s.seq.num_output >= mt:
            sched.finish(s.seq, FinishReason.LENGTH)
    return plan


def drain(sched: Scheduler, ranks: FakeRanks, limit: int = 10_000) -> None:
    for _ in range(limit):
        if not sched.has_work:
            return
        assert step(sched, ranks) is not None, "work left but nothing scheduled"
    raise AssertionError("the scheduler did not finish its work")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


def make(
    num_pages: int = 32, pt: int = 4, max_num_seqs: int = 16,
    max_num_batched_tokens: int = 512, max_model_len: int = 4096,
) -> tuple[Scheduler, FakeRanks]:
    cfg = SchedulerConfig(
        num_pages=num_pages, page_tokens=pt, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
    )
    sched = Scheduler(cfg, FP)
    return sched, FakeRanks(sched)


def test_exact_pages_of_one_request() -> None:
    sched, ranks = make(num_pages=8)
    seq = Seq(list(range(1, 11)), greedy(4), seq_id=1)
    sched.add(seq)
    p1 = step(sched, ranks)
    assert p1 is not None and p1.step == 1
    (ch,) = p1.chunks
    assert (ch.tokens, ch.start_pos, ch.block_table, ch.sample) == (
        list(range(1, 11)), 0, [0, 1, 2], True)
    assert sched.pool.ref == [1, 1, 1, 0, 0, 0, 0, 0]
    keys = page_keys(list(range(1, 11)), 4, FP)
    assert sched.pool.key[:3] == [keys[0], keys[1], None]   # only full pages are keyed
    p2 = step(sched, ranks)
    assert p2 is not None
    assert (p2.chunks[0].start_pos, p2.chunks[0].block_table) == (10, [0, 1, 2])
    assert p2.chunks[0].sampling.step_index == 1
    step(sched, ranks)                                      # position 11 fills page 2
    p4 = step(sched, ranks)
    assert p4 is not None and p4.chunks[0].block_table == [0, 1, 2, 3]
    assert seq.is_finished and seq.finish_reason is FinishReason.LENGTH
    assert seq.output_tokens == reference(list(range(1, 11)), 4)
    # released tail first, each to the back: page 3 holds the partial tail (position
    # 12), kept for a prompt that starts the same; keyed 2, 1, 0 in LRU order
    assert sched.pool.free_order() == [4, 5, 6, 7, 3, 2, 1, 0]
    assert sched.pool.ref == [0] * 8


def test_shared_prefix_is_a_memory_hit_with_ref_counts() -> None:
    sched, ranks = make(num_pages=16)
    prefix = list(range(100, 108))                           # two full pages
    a = Seq([*prefix, 1, 2, 3], greedy(6), seq_id=1)
    sched.add(a)
    step(sched, ranks)
    b = Seq([*prefix, 9], greedy(3), seq_id=2)
    sched.add(b)
    plan = step(sched, ranks)
    assert plan is not None
    chb = next(c for c in plan.chunks if c.seq_id == 2)
    assert (chb.start_pos, chb.tokens, chb.block_table[:2]) == (8, [9], a.block_table[:2])
    assert sched.pool.ref[a.block_table[0]] == 2 and sched.pool.ref[a.block_table[1]] == 2
    assert b.cached_memory == 8 and b.cached_disk == 0
    drain(sched, ranks)
    assert a.output_tokens == reference(a.prompt_tokens, 6)
    assert b.output_tokens == reference(b.prompt_tokens, 3)
    c = sched.pool.counters
    assert (c.prompt_memory, c.prompt_disk, c.prompt_computed) == (8, 0, 11 + 1)


def _seen_then_again(prompt: list[int]) -> tuple[Scheduler, FakeRanks, Seq]:
    """A scheduler of 8 pages that ran ``prompt`` to its end, and the same prompt again
    added (not yet scheduled)."""
    sched, ranks = make(num_pages=8)
    sched.add(Seq(prompt, greedy(1), seq_id=1))
    drain(sched, ranks)
    again = Seq(prompt, greedy(2), seq_id=2)
    sched.add(again)
    return sched, ranks, again


def test_a_fully_cached_prompt_computes_only_its_last_token() -> None:
    prompt = list(range(8))
    sched, ranks, b = _seen_then_again(prompt)
    plan = step(sched, ranks)
    assert plan is not None
    ch = plan.chunks[0]
    # page 0 is a hit; page 1 is copied (its first 3 tokens are what b needs): the
    # token b samples from is the only one computed
    assert (ch.start_pos, ch.tokens) == (7, [7])
    assert plan.copies == [PageCopy(src=1, dst=ch.block_table[1])]   # a's page 1
    assert b.cached_memory == 7
    drain(sched, ranks)
    assert b.output_tokens == reference(prompt, 2)


def test_a_finished_sequences_partial_tail_is_copied_then_written_apart() -> None:
    sched, ranks = make(num_pages=16)
    a = Seq([*range(10, 16)], greedy(2), seq_id=1)       # 6 + 2 tokens: 7 with KV
    sched.add(a)
    drain(sched, ranks)
    tail = [*range(10, 16), a.output_tokens[0]]          # what a's pages hold
    # b starts with all of it and goes on: pages 0 (hit) and 1 (a copy of 3 tokens)
    b = Seq([*tail, 7, 8], greedy(4), seq_id=2)
    c = Seq([*tail[:5], 99, 98], greedy(4), seq_id=3)    # shares only 1 of the tail
    sched.add(b)
    sched.add(c)
    plan = step(sched, ranks)
    assert plan is not None
    chb, chc = plan.chunks
    assert (chb.start_pos, chc.start_pos) == (7, 5)
    srcs = {cp.src for cp in plan.copies}
    assert len(plan.copies) == 2 and len(srcs) == 1      # both from a's tail page
    assert {cp.dst for cp in plan.copies} == {chb.block_table[1], chc.block_table[1]}
    assert (b.cached_memory, c.cached_memory) == (7, 5)
    drain(sched, ranks)
    assert b.output_tokens == reference(b.prompt_tokens, 4)
    assert c.output_tokens == reference(c.prompt_tokens, 4)
    sched.pool.check([])


def test_an_undone_step_cuts_a_copied_page_back_and_releases_its_source() -> None:
    prompt = list(range(8))
    sched, ranks, b = _seen_then_again(prompt)
    plan, _ = sched.schedule()
    assert plan is not None and plan.copies
    src = plan.copies[0].src
    assert sched.pool.ref[src] == 1                      # held while the step is out
    sched.undo_step()                                    # the step ran on no rank
    assert sched.pool.ref[src] == 0 and b.num_computed == 4 and len(b.block_table) == 1
    assert b.cached_memory == 4
    drain(sched, ranks)
    assert b.output_tokens == reference(prompt, 2)


def test_lru_eviction_order() -> None:
    sched, ranks = make(num_pages=4)
    old = Seq([*list(range(8)), 50], greedy(1), seq_id=1)       # keys pages 0, 1
    sched.add(old)
    drain(sched, ranks)
    assert sched.pool.free_order() == [3, 2, 1, 0]   # 2: the partial tail (position 8)
    new = Seq(list(range(200, 212)), greedy(1), seq_id=2)       # needs 3 fresh pages
    sched.add(new)
    plan = step(sched, ranks)
    assert plan is not None
    assert plan.chunks[0].block_table == [3, 2, 1]                    # evicts the tail first
    assert sched.pool.counters.evictions == 1
    assert sched.pool.match(page_keys(list(range(8)), 4, FP)) == [0]  # page 0 still a hit


def test_chunked_prefill_never_stalls_decodes() -> None:
    sched, ranks = make(num_pages=64, max_num_batched_tokens=8, max_num_seqs=8)
    decoders = [Seq([i, i + 1, i + 2], greedy(20), seq_id=i) for i in range(3)]
    for d in decoders:
        sched.add(d)
    step(sched, ranks)                                       # 9 tokens > 8: two steps
    step(sched, ranks)
    assert [d.num_output for d in decoders] == [2, 2, 1]
    long = Seq(list(range(500, 530)), greedy(2), seq_id=10)
    sched.add(long)
    seen_chunks = 0
    while not long.output_tokens:
        before = [d.num_output for d in decoders]
        plan = step(sched, ranks)
        assert plan is not None
        assert sum(len(c.tokens) for c in plan.chunks) <= 8
        assert [d.num_output for d in decoders] == [b + 1 for b in before]
        lc = [c for c in plan.chunks if c.seq_id == 10]
        if lc:
            seen_chunks += 1
            assert len(lc[0].tokens) <= 8 - 3
    assert seen_chunks == 6                                  # 30 tokens, 5 a step
    drain(sched, ranks)
    assert long.output_tokens == reference(long.prompt_tokens, 2)
    for d in decoders:
        assert d.output_tokens == reference(d.prompt_tokens, 20)


def test_preemption_recomputes_the_newest_and_corrupts_nobody() -> None:
    # 6 pages of 4 tokens; two requests that grow to 16 tokens each need 8 pages
    sched, ranks = make(num_pages=6)
    a = Seq(list(range(1, 7)), greedy(10), seq_id=1)
    b = Seq(list(range(40, 46)), greedy(10), seq_id=2)
    sched.add(a)
    sched.add(b)
    statuses: list[tuple[SeqStatus, SeqStatus]] = []
    for _ in range(200):
        if not sched.has_work:
            break
        step(sched, ranks)
        statuses.append((a.status, b.status))
    assert not sched.has_work
    assert b.num_preemptions >= 1 and a.num_preemptions == 0    # the newest one yields
    assert (SeqStatus.RUNNING, SeqStatus.WAITING) in statuses
    assert sched.pool.counters.preemptions == b.num_preemptions
    assert sched.pool.counters.recomputed > 0
    assert a.output_tokens == reference(a.prompt_tokens, 10)
    assert b.output_tokens == reference(b.prompt_tokens, 10)
    assert b.cached_memory == 0     # counted at its first admission only


def test_waiting_requests_wait_for_pages() -> None:
    sched, ranks = make(num_pages=4)
    a = Seq(list(range(12)), greedy(3), seq_id=1)   # 3 pages, 4 at the end
    b = Seq(list(range(60, 72)), greedy(1), seq_id=2)
    sched.add(a)
    sched.add(b)
    step(sched, ranks)
    assert a.status is SeqStatus.RUNNING and b.status is SeqStatus.WAITING
    assert b.block_table == []
    drain(sched, ranks)
    assert a.output_tokens == reference(a.prompt_tokens, 3)
    assert b.output_tokens == reference(b.prompt_tokens, 1)


def test_cancellation_frees_pages_at_the_next_step() -> None:
    sched, ranks = make(num_pages=8)
    a = Seq(list(range(10)), greedy(20), seq_id=1)
    w = Seq(list(range(30, 40)), greedy(5), seq_id=2)
    sched.add(a)
    step(sched, ranks)
    sched.add(w)
    assert sched.abort(1) and sched.abort(2) and not sched.abort(99)
    assert sched.pool.num_free == 5                      # nothing freed until the step
    plan, aborted = sched.schedule()
    assert plan is None and aborted == [a, w]
    assert a.finish_reason is FinishReason.ABORT and w.status is SeqStatus.FINISHED
    assert sched.pool.num_free == 8 and not sched.has_work


def test_sixteen_requests_join_while_others_decode() -> None:
    sched, ranks = make(num_pages=96, max_num_seqs=16, max_num_batched_tokens=32)
    system = list(range(300, 313))                       # 3 full pages + 1
    prompts: list[list[int]] = []
    for i in range(16):
        if i % 3 == 0:
            prompts.append([1000 + i] * (5 + i))         # distinct
        else:
            prompts.append(system + list(range(i, i + 2 + (i * 7) % 11)))
    seqs = [Seq(p, greedy(6 + i % 5), seq_id=i) for i, p in enumerate(prompts)]
    joined = 0
    joined_during_decode = 0
    for _ in range(1000):
        if joined < 16:
            joined_during_decode += any(r.num_output > 0 for r in sched.running)
            sched.add(seqs[joined])                      # one joins at every step
            joined += 1
        if not sched.has_work and joined == 16:
            break
        step(sched, ranks)
    assert joined == 16 and not sched.has_work and joined_during_decode >= 12
    for s in seqs:
        assert s.output_tokens == reference(s.prompt_tokens, s.params.max_tokens or 0), s
    assert sched.pool.counters.prompt_memory > 0
    assert max(len(p.chunks) for p in ranks.plans) > 4   # they really ran together


def test_disk_tier_loads_past_memory_and_saves_new_pages() -> None:
    tier = InMemoryTier()
    disk: dict[bytes, list[int]] = {}
    cfg = SchedulerConfig(num_pages=16, page_tokens=4)
    sched = Scheduler(cfg, FP, tier)
    ranks = FakeRanks(sched, disk)
    prompt = list(range(7, 20))                          # 3 full pages + 1
    a = Seq(prompt, greedy(3), seq_id=1)
    sched.add(a)
    plan = step(sched, ranks)
    assert plan is not None and len(plan.saves) == 1
    keys = page_keys(prompt, 4, FP)
    assert plan.saves[0].keys == keys and plan.saves[0].page_ids == a.block_table[:3]
    assert tier.saves == [keys]                          # stored after the step
    drain(sched, ranks)
    # a restart: a new pool (nothing in memory), the same disk tier
    sched2 = Scheduler(cfg, FP, tier)
    ranks2 = FakeRanks(sched2, disk)
    b = Seq([*prompt[:12], 77, 78], greedy(4), seq_id=2)
    sched2.add(b)
    plan2 = step(sched2, ranks2)
    assert plan2 is not None
    (ld,) = plan2.loads
    assert ld.keys == keys and ld.page_ids == b.block_table[:3]
    assert plan2.chunks[0].start_pos == 12 and plan2.saves == []
    assert tier.pins == {}                               # unpinned after the step
    assert (b.cached_memory, b.cached_disk) == (0, 12)
    drain(sched2, ranks2)
    assert b.output_tokens == reference(b.prompt_tokens, 4)
    assert sched2.pool.counters.prompt_disk == 12
    # memory first, then disk: a third request hits memory for what b loaded
    c = Seq([*prompt[:12], 5], greedy(1), seq_id=3)
    sched2.add(c)
    plan3 = step(sched2, ranks2)
    assert plan3 is not None and plan3.loads == [] and c.cached_memory == 12


def test_a_tier_refusing_stores_costs_only_a_miss() -> None:
    tier = InMemoryTier(accept=False)
    sched = Scheduler(SchedulerConfig(num_pages=16, page_tokens=4), FP, tier)
    ranks = FakeRanks(sched)
    a = Seq(list(range(9)), greedy(3), seq_id=1)
    sched.add(a)
    drain(sched, ranks)
    assert all(p.saves == [] for p in ranks.plans) and tier.asked
    assert a.output_tokens == reference(a.prompt_tokens, 3)


def test_requests_that_cannot_fit_are_refused() -> None:
    sched, _ = make(num_pages=4, max_model_len=64)
    with pytest.raises(RequestError, match="need 5 KV pages, the pool has 4"):
        sched.add(Seq(list(range(10)), greedy(10), seq_id=1))
    with pytest.raises(RequestError, match="max_model_len=64"):
        sched.add(Seq(list(range(64)), greedy(1), seq_id=2))
    with pytest.raises(RequestError, match="empty"):
        sched.add(Seq([], greedy(1), seq_id=3))
    sched.add(Seq([1], greedy(1), seq_id=4))
    with pytest.raises(RequestError, match="already scheduled"):
        sched.add(Seq([1], greedy(1), seq_id=4))
    with pytest.raises(SchedulerError, match="max_num_seqs"):
        SchedulerConfig(num_pages=4, max_num_seqs=8, max_num_batched_tokens=4)


def test_results_must_match_the_step_in_flight() -> None:
    sched, _ranks = make()
    sched.add(Seq([1, 2, 3], greedy(2), seq_id=1))
    plan, _ = sched.schedule()
    assert plan is not None
    with pytest.raises(SchedulerError, match="still in flight"):
        sched.schedule()
    with pytest.raises(SchedulerError, match="no token for sequence 1"):
        sched.update(StepResult(step=plan.step, tokens={}))


def test_prefix_caching_off_computes_every_prompt() -> None:
    cfg = SchedulerConfig(num_pages=16, page_tokens=4, enable_prefix_caching=False)
    tier = InMemoryTier()
    sched = Scheduler(cfg, FP, tier)
    ranks = FakeRanks(sched)
    prompt = list(range(9))
    for i in range(2):
        s = Seq(prompt, greedy(2), seq_id=i)
        sched.add(s)
        drain(sched, ranks)
        assert s.cached_tokens == 0 and s.output_tokens == reference(prompt, 2)
    assert sched.pool.num_cached == 0 and tier.asked == []
    assert all(p.loads == [] and p.saves == [] for p in ranks.plans)


def test_two_requests_loading_one_prefix_in_a_step_share_it() -> None:
    prompt = list(range(30, 43))
    keys = page_keys(prompt, 4, FP)
    disk = {k: prompt[i * 4 : (i + 1) * 4] for i, k in enumerate(keys)}
    tier = InMemoryTier(keys)
    sched = Scheduler(SchedulerConfig(num_pages=16, page_tokens=4), FP, tier)
    ranks = FakeRanks(sched, disk)
    a = Seq([*prompt[:12], 1], greedy(2), seq_id=1)
    b = Seq([*prompt[:12], 2], greedy(2), seq_id=2)
    sched.add(a)
    sched.add(b)
    plan = step(sched, ranks)
    assert plan is not None and len(plan.loads) == 1          # loaded once
    assert a.block_table[:3] == b.block_table[:3] == plan.loads[0].page_ids
    assert (a.cached_disk, b.cached_memory) == (12, 12)
    drain(sched, ranks)
    assert a.output_tokens == reference(a.prompt_tokens, 2)
    assert b.output_tokens == reference(b.prompt_tokens, 2)


class CountingTier(InMemoryTier):
    """An in-memory tier that records every lookup's start page."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        super().__init__(keys)
        self.lookups: list[int] = []

    def lookup(self, keys: Sequence[bytes], start: int) -> int:
        self.lookups.append(start)
        return super().lookup(keys, start)


def test_a_blocked_queue_head_does_not_ask_the_disk_tier() -> None:
    prompt = list(range(50, 63))
    keys = page_keys(prompt, 4, FP)
    tier = CountingTier(keys)
    sched = Scheduler(SchedulerConfig(num_pages=6, page_tokens=4), FP, tier)
    ranks = FakeRanks(sched, {k: prompt[i * 4 : (i + 1) * 4] for i, k in enumerate(keys)})
    hog = Seq(list(range(200, 216)), greedy(8), seq_id=1)   # 4 pages, up to 6
    sched.add(hog)
    step(sched, ranks)
    tier.lookups.clear()                                          # the hog's own lookup
    late = Seq(prompt, greedy(2), seq_id=2)                  # needs 4 pages
    sched.add(late)
    for _ in range(3):
        step(sched, ranks)
        assert late.status is SeqStatus.WAITING
    assert tier.lookups == []
    drain(sched, ranks)
    assert tier.lookups == [0] and late.cached_disk == 12
    assert late.output_tokens == reference(prompt, 2)
