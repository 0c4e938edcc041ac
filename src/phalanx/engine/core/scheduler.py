"""Continuous batching: waiting and running sequences in, one frozen StepPlan out.

Pure logic (no torch, no processes). One step:

1. Cancelled sequences leave and free their pages (the step after ``abort``).
2. Running sequences, oldest first, each get their next tokens from one token budget
   (``max_num_batched_tokens``): one decode token, or a prefill chunk. A prefill chunk
   leaves one token of budget for every decode behind it in the list, so a long prompt
   never stalls the running decodes. If a sequence needs a page and none is free, the
   newest running sequence is preempted (its pages freed, its tokens recomputed when it
   runs again; if it is the one asking, it stops there) — never failing the others.
3. If nobody was preempted, waiting sequences are admitted first come first served
   while the budget, ``max_num_seqs`` and the pages allow; the head of the queue
   waits if it does not fit (no overtaking, so nobody starves). An admission takes the
   longest prefix of full pages held in memory (shared, ref counted), then asks the disk
   tier how many further pages it can load (``PageLoad`` into fresh pages), then copies
   the page holding the longest start of what is left (a keyed page, or a finished
   sequence's partial last page: ``PageCopy``), and computes the rest in chunks. A
   prompt seen before computes one token: the one it samples from.

After the forward, :meth:`Scheduler.update` advances the computed counts, gives pages
that became full their keys (only then are they hits for others; a page loaded from
disk is keyed at once, since loads run before the forward), unpins the disk tier's
pages, and appends the sampled tokens. Finishing (EOS, stops, max_tokens) is
the engine loop's decision: it calls :meth:`Scheduler.finish`.

A step whose disk loads failed on some rank did not run on any rank
(``StepResult.load_failures``): :meth:`Scheduler.update` undoes it. The pages it loaded
lose their keys (their KV is not what the key says on every rank), every sequence of
the step keeps only what it had computed or found in memory before the step (its
running state cut back to the first page the step loaded), and the next step computes
the rest: the loads became misses. The sequences stay running, so they do not ask the
disk tier again.

Invariants (checked at the end of every schedule and update when ``check_invariants``):
ref counts equal block-table holdings, the free list is the unreferenced pages, waiting
sequences hold no pages, each running block table covers exactly its computed tokens
plus what is scheduled, the budget and ``max_num_seqs`` hold.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ...kvstore import page_keys
from .._errors import RequestError, SchedulerError
from .kv_pages import ROOT, PagePool
from .plan import (
    PageCopy,
    PageLoad,
    PageSave,
    SeqChunk,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from .sequence import FinishReason, Seq, SeqStatus

__all__ = ["PrefixTier", "Sampled", "Scheduler", "SchedulerConfig"]


class PrefixTier(Protocol):
    """The disk tier as rank 0's scheduler sees it (the replicated persistent cache).

    ``keys`` is always a sequence's chain from its first page (a key names its prefix).
    ``lookup(keys, start)`` answers how many pages of ``keys[start:]`` every rank can
    load now, and holds them (pinned, or already delivered to the ranks) until
    ``unpin``; ``wants`` says, per page of ``keys[start:]`` a step is about to fill,
    whether to stage it for storing; ``saved(keys)`` follows the step that staged the
    last of ``keys`` (store them in the background: admission, room and thinning are
    the tier's decisions, and a refusal only costs a later miss).
    """

    def lookup(self, keys: Sequence[bytes], start: int) -> int: ...

    def unpin(self, keys: Sequence[bytes]) -> None: ...

    def wants(self, keys: Sequence[bytes], start: int) -> list[bool]: ...

    def saved(self, keys: Sequence[bytes]) -> None: ...


@dataclass(frozen=True)
class SchedulerConfig:
    num_pages: int
    page_tokens: int = 64
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096
    enable_prefix_caching: bool = True   # False: every prompt is computed (the oracle)
    check_invariants: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise SchedulerError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is below "
                f"max_num_seqs={self.max_num_seqs}: the running decodes could not all step"
            )


@dataclass(frozen=True)
class Sampled:
    """A token sampled for ``seq`` at the last step."""

    seq: Seq
    token: int
    logprobs: TokenLogprobs | None


@dataclass
class _Scheduled:
    seq: Seq
    n: int
    sample: bool
    loaded: list[bytes]
    saved_upto: int = 0      # chain pages through the last page this step stages
    load_pages: tuple[int, ...] = ()   # the pages its PageLoad fills
    # admitted by this step: (first admission, prompt tokens counted as memory hits), to
    # count the admission again if the step's loads fail
    admitted: tuple[bool, int] | None = None
    # a page copy of this step: (source page, held until the step ran; destination)
    copied: tuple[int, int] | None = None


def _pages_for(tokens: int, pt: int) -> int:
    return -(-tokens // pt)


class Scheduler:
    """Turns waiting and running sequences into one StepPlan per step; see module doc."""

    def __init__(
        self, config: SchedulerConfig, fingerprint: bytes, tier: PrefixTier | None = None,
    ) -> None:
        self.config = config
        self.pool = PagePool(config.num_pages, config.page_tokens)
        self.fingerprint = fingerprint
        self.tier = tier
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self._by_id: dict[int, Seq] = {}
        self._inflight: list[_Scheduled] | None = None
        self._step = 0

    # -- requests ---------------------------------------------------------------------

    def add(self, seq: Seq) -> None:
        """Queue a new request; refuse one that could never fit the context or the pool."""
        c = self.config
        if seq.seq_id in self._by_id:
            raise RequestError(f"request {seq.seq_id} is already scheduled")
        if not seq.prompt_tokens:
            raise RequestError(f"request {seq.seq_id}: the prompt is empty")
        if seq.num_prompt >= c.max_model_len:
            raise RequestError(
                f"request {seq.seq_id}: prompt of {seq.num_prompt} tokens leaves no room "
                f"to generate within max_model_len={c.max_model_len}"
            )
        longest = c.max_model_len
        if seq.params.max_tokens is not None:
            longest = min(longest, seq.num_prompt + seq.params.max_tokens)
        if _pages_for(longest, c.page_tokens) > c.num_pages:
            raise RequestError(
                f"request {seq.seq_id}: up to {longest} tokens need "
                f"{_pages_for(longest, c.page_tokens)} KV pages, the pool has {c.num_pages}"
            )
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
        self._by_id[seq.seq_id] = seq

    def abort(self, seq_id: int) -> bool:
        """Cancel a request: it leaves and frees its pages at the next step."""
        seq = self._by_id.get(seq_id)
        if seq is None:
            return False
        seq.cancelled = True
        return True

    def finish(self, seq: Seq, reason: FinishReason) -> None:
        """End ``seq``: release its pages (full ones stay cached) and forget it."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        self._keep_tail(seq)
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self._by_id.pop(seq.seq_id, None)

    def _keep_tail(self, seq: Seq) -> None:
        """Keep ``seq``'s partial last page findable by what it holds (see kv_pages)."""
        pt = self.config.page_tokens
        full, part = divmod(seq.num_computed, pt)
        if not (self.config.enable_prefix_caching and part and len(seq.block_table) > full):
            return
        parent = self._keys(seq, full)[-1] if full else ROOT
        self.pool.keep_tail(seq.block_table[full], parent,
                            seq.tokens_range(full * pt, seq.num_computed))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)


    # -- one step ---------------------------------------------------------------------

    def schedule(self) -> tuple[StepPlan | None, list[Seq]]:
        """The next step's plan (None when there is nothing to run) and the cancelled."""
        if self._inflight is not None:
            raise SchedulerError(f"step {self._step} is still in flight: update() first")
        c = self.config
        pt = c.page_tokens
        aborted = [s for s in (*self.running, *self.waiting) if s.cancelled]
        for s in aborted:
            self.finish(s, FinishReason.ABORT)
        budget = c.max_num_batched_tokens
        scheduled: list[_Scheduled] = []
        chunks: list[SeqChunk] = []
        loads: list[PageLoad] = []
        copies: list[PageCopy] = []
        saves: list[PageSave] = []
        preempted = False

        decodes_behind = sum(1 for s in self.running if len(s) - s.num_computed == 1)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = len(seq) - seq.num_computed
            if remaining == 1:
                decodes_behind -= 1
                n = 1
            else:
                n = min(remaining, budget - decodes_behind)
                if n <= 0:
                    i += 1
                    continue
            need = _pages_for(seq.num_computed + n, pt) - len(seq.block_table)
            while need > self.pool.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break
            seq.block_table += self.pool.allocate(need)
            self._emit(seq, n, [], scheduled, chunks, saves)
            budget -= n
            i += 1

        while (not preempted and self.waiting and budget > 0
               and len(self.running) < c.max_num_seqs):
            seq = self.waiting[0]
            if not self._admit(seq, budget, scheduled, chunks, loads, copies, saves):
                break
            budget -= scheduled[-1].n

        if not chunks:
            return None, aborted
        self._step += 1
        self._inflight = scheduled
        plan = StepPlan(step=self._step, chunks=chunks, loads=loads, copies=copies,
                        saves=saves)
        if c.check_invariants:
            self._check(scheduled)
        return plan, aborted

    def _admit(
        self, seq: Seq, budget: int, scheduled: list[_Scheduled], chunks: list[SeqChunk],
        loads: list[PageLoad], copies: list[PageCopy], saves: list[PageSave],
    ) -> bool:
        pt = self.config.page_tokens
        total = len(seq)
        limit = (total - 1) // pt        # at least one token is computed, to sample from
        caching = self.config.enable_prefix_caching
        keys = self._keys(seq, limit)[:limit] if caching else []
        hits = self.pool.match(keys)
        m = len(hits)
        # pages loaded from disk only add to what the step needs: if the request does not
        # fit without them, it waits without asking the disk tier (a blocked head of the
        # queue must not cost a disk lookup per step)
        if not self.pool.can_allocate(
                _pages_for(min(total, m * pt + budget), pt) - m, hits):
            return False
        d = 0
        if caching and self.tier is not None and m < limit:
            d = self.tier.lookup(keys, m)
        computed = (m + d) * pt
        # the tail after the full pages: copied from the page holding its longest start,
        # all but the last token (the one sampled from)
        src, j = -1, 0
        if caching and computed < total - 1:
            parent = keys[m + d - 1] if m + d else ROOT
            src, j = self.pool.match_tail(parent, seq.tokens_range(computed, total - 1))
        n = min(total - computed - j, budget)
        need = _pages_for(computed + j + n, pt) - m
        held = [*hits, src] if j else hits
        if not self.pool.can_allocate(need, held):
            if d and self.tier is not None:
                self.tier.unpin(keys[m : m + d])
            return False
        self.waiting.popleft()
        self.pool.acquire(held)   # the copy's source stays what it is until the step ran
        fresh = self.pool.allocate(need)
        seq.block_table = hits + fresh
        if j:
            copies.append(PageCopy(src=src, dst=fresh[d]))
        computed += j
        seq.num_computed = computed
        loaded = keys[m : m + d]
        if d:
            loads.append(PageLoad(keys=list(loaded), page_ids=fresh[:d]))
            # loads run before the step's forward, so a loaded page is a hit at once:
            # another request admitted in this step shares it instead of loading it again
            for i, (page, key) in enumerate(zip(fresh[:d], loaded, strict=True)):
                self.pool.register(page, key, keys[m + i - 1] if m + i else ROOT,
                                   seq.tokens_range((m + i) * pt, (m + i + 1) * pt))
        seq.num_registered = m + d
        first = seq.take_first_admit()
        self._count_admit(seq, first, m * pt + j, computed)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self._emit(seq, n, list(loaded), scheduled, chunks, saves)
        scheduled[-1].load_pages = tuple(fresh[:d])
        scheduled[-1].admitted = (first, m * pt + j)
        if j:
            scheduled[-1].copied = (src, fresh[d])
        return True

    def _count_admit(self, seq: Seq, first: bool, memory: int, computed: int,
                     sign: int = 1) -> None:
        """Count an admission that found ``memory`` tokens in memory and ``computed`` in
        all (``sign`` -1: take it back)."""
        counters = self.pool.counters
        p = seq.num_prompt
        if first:
            if sign > 0:
                seq.cached_memory = memory
                seq.cached_disk = computed - memory
            counters.prompt_memory += sign * min(memory, p)
            counters.prompt_disk += sign * (min(computed, p) - min(memory, p))
            counters.prompt_computed += sign * max(0, p - computed)
        else:
            counters.recomputed += sign * (len(seq) - computed)

    def _emit(
        self, seq: Seq, n: int, loaded: list[bytes], scheduled: list[_Scheduled],
        chunks: list[SeqChunk], saves: list[PageSave],
    ) -> None:
        pt = self.config.page_tokens
        start = seq.num_computed
        end = start + n
        sample = end == len(seq)
        chunks.append(SeqChunk(
            seq_id=seq.seq_id,
            tokens=seq.tokens_range(start, end),
            start_pos=start,
            block_table=list(seq.block_table),
            sample=sample,
            sampling=seq.params.spec(seq.num_output),
        ))
        entry = _Scheduled(seq, n, sample, loaded)
        scheduled.append(entry)
        if self.tier is None or not self.config.enable_prefix_caching:
            return
        # pages this step fills with prompt tokens it computes: store them in the background
        first, last = start // pt, min(end, seq.num_prompt) // pt
        if last > first:
            keys = self._keys(seq, last)
            wanted = self.tier.wants(keys, first)
            pick = [first + j for j, w in enumerate(wanted) if w]
            if pick:
                saves.append(PageSave(
                    keys=[keys[j] for j in pick],
                    page_ids=[seq.block_table[j] for j in pick],
                ))
                entry.saved_upto = pick[-1] + 1

    def _keys(self, seq: Seq, n_pages: int) -> list[bytes]:
        """The first ``n_pages`` keys of ``seq``'s chain, extending it as needed."""
        chain = seq.key_chain
        have = len(chain)
        if n_pages > have:
            pt = self.config.page_tokens
            tokens = seq.tokens_range(have * pt, n_pages * pt)
            if chain:
                chain.extend(page_keys(tokens, pt, self.fingerprint, parent=chain[-1]))
            else:
                chain.extend(page_keys(tokens, pt, self.fingerprint))
        return chain[:n_pages]

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.num_registered = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.pool.counters.preemptions += 1
        self.waiting.appendleft(seq)

    def update(self, result: StepResult) -> list[Sampled]:
        """Apply rank 0's result of the step in flight; returns the sampled tokens."""
        scheduled = self._inflight
        if scheduled is None or result.step != self._step:
            raise SchedulerError(
                f"result of step {result.step}, but step {self._step} is "
                f"{'in flight' if scheduled is not None else 'not in flight'}"
            )
        if result.load_failures:
            self.undo_step()
            return []
        pt = self.config.page_tokens
        out: list[Sampled] = []
        for s in scheduled:
            seq = s.seq
            if s.copied is not None:
                self.pool.release([s.copied[0]])
            seq.num_computed += s.n
            if self.config.enable_prefix_caching:
                # full pages become hits only now, after the step that wrote them ran
                full = seq.num_computed // pt
                keys = self._keys(seq, full)
                for j in range(seq.num_registered, full):
                    self.pool.register(seq.block_table[j], keys[j], keys[j - 1] if j else ROOT,
                                       seq.tokens_range(j * pt, (j + 1) * pt))
                seq.num_registered = full
            if s.loaded and self.tier is not None:
                self.tier.unpin(s.loaded)
            if s.saved_upto and self.tier is not None:
                self.tier.saved(seq.key_chain[: s.saved_upto])
            if s.sample:
                tok = result.tokens.get(seq.seq_id)
                if tok is None:
                    raise SchedulerError(
                        f"step {result.step}: rank 0 returned no token for sequence "
                        f"{seq.seq_id}"
                    )
                seq.output_tokens.append(tok)
                out.append(Sampled(seq, tok, result.logprobs.get(seq.seq_id)))
        self._inflight = None
        if self.config.check_invariants:
            self._check([])
        return out

    def undo_step(self) -> list[Seq]:
        """The step in flight ran on no rank (a disk load failed on one, or the parent
        could not encode its plan): see the module docstring. Its loaded pages are
        forgotten, and every sequence is cut back to its pages before the first one the
        step loaded (or allocated for it). Returns the step's sequences."""
        scheduled = self._inflight
        if scheduled is None:
            raise SchedulerError(f"undo of step {self._step}, which is not in flight")
        pt = self.config.page_tokens
        tainted = {p for s in scheduled for p in s.load_pages}
        for p in tainted:
            self.pool.forget(p)
        # a copy's destination holds nothing either (unkeyed: only its sequence has it)
        tainted |= {s.copied[1] for s in scheduled if s.copied is not None}
        for s in scheduled:
            seq = s.seq
            if s.loaded and self.tier is not None:
                self.tier.unpin(s.loaded)
            if s.copied is not None:
                self.pool.release([s.copied[0]])
            keep = _pages_for(seq.num_computed, pt)
            # a later admission of the step may hold another's loaded pages as hits
            keep = next((i for i, p in enumerate(seq.block_table[:keep]) if p in tainted),
                        keep)
            old = seq.num_computed
            seq.num_computed = min(old, keep * pt)
            seq.num_registered = min(seq.num_registered, keep)
            self.pool.release(seq.block_table[keep:])
            del seq.block_table[keep:]
            if s.admitted is not None:
                first, memory = s.admitted
                self._count_admit(seq, first, memory, old, sign=-1)
                self._count_admit(seq, first, seq.num_computed, seq.num_computed)
        self._inflight = None
        if self.config.check_invariants:
            self._check([])
        return [s.seq for s in scheduled]

    def fail_inflight(self) -> list[Seq]:
        """Drop the step in flight (the ranks failed it); returns every live sequence."""
        for s in self._inflight or ():
            if s.loaded and self.tier is not None:
                self.tier.unpin(s.loaded)
            if s.copied is not None:
                self.pool.release([s.copied[0]])
        self._inflight = None
        return [*self.running, *self.waiting]

    def _check(self, scheduled: list[_Scheduled]) -> None:
        c = self.config
        sources = [[s.copied[0]] for s in scheduled if s.copied is not None]
        self.pool.check([*(s.block_table for s in self.running), *sources])
        if len(self.running) > c.max_num_seqs:
            raise SchedulerError(f"{len(self.running)} running > max_num_seqs={c.max_num_seqs}")
        if sum(s.n for s in scheduled) > c.max_num_batched_tokens:
            raise SchedulerError("a step over its token budget")
        for w in self.waiting:
            if w.block_table or w.num_computed:
                raise SchedulerError(f"waiting sequence {w.seq_id} holds pages or KV")
        pending = {s.seq.seq_id: s.n for s in scheduled}
        for r in self.running:
            covered = r.num_computed + pending.get(r.seq_id, 0)
            if len(r.block_table) != _pages_for(covered, c.page_tokens):
                raise SchedulerError(
                    f"sequence {r.seq_id}: {len(r.block_table)} pages for {covered} tokens"
                )
