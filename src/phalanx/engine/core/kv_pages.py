"""The engine's KV page pool: decided in the parent, mirrored by page id in every rank.

A page holds ``page_tokens`` tokens of KV. Pages are

- *in use*: ref counted, one reference per running sequence whose block table holds it
  (sequences with a common prefix share its full pages);
- *free*: in an O(1) LRU (an OrderedDict). A free page that still holds a
  full, keyed prefix page stays a cache hit until it is evicted, i.e. until it reaches
  the front of the LRU and is allocated for something else. Unkeyed free pages go to the
  front (they hold nothing worth keeping), keyed ones to the back.

Keys are the disk tier's hash chain (:mod:`phalanx.kvstore.keys`): a page's key is the
BLAKE2b of its parent's key and its tokens, keyed by the model fingerprint, so a memory
page and a disk record of the same prefix share a key, and a key names its whole
prefix. A page's key is set once, after the step that filled it ran (never while its KV
is being written), and cleared when it is evicted (or forgotten: a disk load
that failed on a rank, :meth:`PagePool.forget`).

A page also remembers which tokens it holds the KV of, under which parent key (the
chain key of the page before it; :data:`ROOT` for a first page): every keyed page, and
the partial last page of a finished sequence (kept like a keyed page: at the back of the
LRU). :meth:`PagePool.match_tail` finds the page whose tokens share the longest start
with a prompt's tail after its full-page hits, so a repeated prompt copies that page
instead of recomputing up to ``page_tokens - 1`` tokens (docs/design.md, "A repeated
prompt recomputes one token").

Check, then commit: :meth:`PagePool.can_allocate`, :meth:`PagePool.match` and
:meth:`PagePool.match_tail` read; :meth:`PagePool.allocate`, :meth:`PagePool.acquire`
and :meth:`PagePool.release` commit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .._errors import SchedulerError

__all__ = ["ROOT", "PagePool", "PrefixCounters"]

ROOT = b""  # the parent of a sequence's first page


@dataclass
class PrefixCounters:
    """Prompt tokens by where their KV came from, over the engine's life."""

    prompt_memory: int = 0     # full pages found in the memory tier
    prompt_disk: int = 0       # full pages loaded from the disk tier
    prompt_computed: int = 0   # computed at first admission
    recomputed: int = 0        # tokens computed again after a preemption
    evictions: int = 0         # keyed free pages given to another use
    preemptions: int = 0


class PagePool:
    """``num_pages`` pages of ``page_tokens`` tokens; see the module docstring."""

    def __init__(self, num_pages: int, page_tokens: int) -> None:
        if num_pages < 1 or page_tokens < 1:
            raise SchedulerError(
                f"a page pool needs pages and tokens per page (got {num_pages} pages of "
                f"{page_tokens} tokens)"
            )
        self.num_pages = num_pages
        self.page_tokens = page_tokens
        self.ref = [0] * num_pages
        self.key: list[bytes | None] = [None] * num_pages
        # LRU: the front is allocated first
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self._cached: dict[bytes, int] = {}
        # what each page holds the KV of: (parent key, tokens), and the pages by parent
        self.held: list[tuple[bytes, tuple[int, ...]] | None] = [None] * num_pages
        # by (parent, first token): a match shares at least its first token, and one
        # parent (a long system prompt's last page) may have thousands of children
        self._children: dict[tuple[bytes, int], set[int]] = {}
        self.counters = PrefixCounters()

    # -- reads ------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def free_order(self) -> list[int]:
        """Free pages, next to be allocated first (for tests and debugging)."""
        return list(self._free)

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """Pages of the longest leading run of ``keys`` held in memory (in use or free)."""
        pages: list[int] = []
        for k in keys:
            p = self._cached.get(k)
            if p is None:
                break
            pages.append(p)
        return pages

    def match_tail(self, parent: bytes, tokens: Sequence[int]) -> tuple[int, int]:
        """The page under ``parent`` whose tokens start like ``tokens`` the longest, and
        how many tokens they share: (page, n), n 0 when none does."""
        best, best_n = -1, 0
        for p in self._children.get((parent, tokens[0]), ()) if tokens else ():
            held = self.held[p]
            assert held is not None
            n = 0
            for a, b in zip(held[1], tokens, strict=False):
                if a != b:
                    break
                n += 1
            if n > best_n:
                best, best_n = p, n
        return best, best_n

    def can_allocate(self, n: int, hits: Iterable[int] = ()) -> bool:
        """Whether ``n`` fresh pages can be allocated after acquiring ``hits``."""
        taken = sum(1 for p in hits if self.ref[p] == 0)
        return n <= len(self._free) - taken

    # -- commits ----------------------------------------------------------------------

    def acquire(self, pages: Iterable[int]) -> None:
        """One more reference to each of ``pages`` (cache hits)."""
        for p in pages:
            if self.ref[p] == 0:
                del self._free[p]
            self.ref[p] += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh pages, evicting the least recently freed keyed pages if need be."""
        if n > len(self._free):
            raise SchedulerError(
                f"page pool: {n} pages asked, {len(self._free)} free of {self.num_pages} "
                "(the scheduler must check can_allocate first)"
            )
        out: list[int] = []
        for _ in range(n):
            p, _ = self._free.popitem(last=False)
            k = self.key[p]
            if k is not None:
                del self._cached[k]
                self.key[p] = None
                self.counters.evictions += 1
            self._drop_held(p)
            self.ref[p] = 1
            out.append(p)
        return out

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page, in reverse order (tail pages are evicted first)."""
        for p in reversed(pages):
            if self.ref[p] <= 0:
                raise SchedulerError(f"page pool: page {p} released with no reference")
            self.ref[p] -= 1
            if self.ref[p] == 0:
                self._free[p] = None
                if self.held[p] is None:
                    self._free.move_to_end(p, last=False)

    def register(self, page: int, key: bytes, parent: bytes, tokens: Sequence[int]) -> bool:
        """Give a just-filled page its key (``parent``'s child, holding ``tokens``); False
        if another page already holds that prefix."""
        if self.key[page] is not None:
            if self.key[page] == key:
                return True
            raise SchedulerError(f"page pool: page {page} already has another key")
        if key in self._cached:
            return False
        self.key[page] = key
        self._cached[key] = page
        self._hold(page, parent, tokens)
        return True

    def keep_tail(self, page: int, parent: bytes, tokens: Sequence[int]) -> None:
        """Remember that the partial ``page`` holds the KV of ``tokens`` after ``parent``
        (a finished sequence's last page, about to be released): a later prompt with the
        same start copies it (:meth:`match_tail`)."""
        if self.key[page] is None and tokens:
            self._hold(page, parent, tokens)

    def _hold(self, page: int, parent: bytes, tokens: Sequence[int]) -> None:
        self._drop_held(page)
        self.held[page] = (parent, tuple(tokens))
        self._children.setdefault((parent, tokens[0]), set()).add(page)

    def _drop_held(self, page: int) -> None:
        held = self.held[page]
        if held is None:
            return
        self.held[page] = None
        key = (held[0], held[1][0])
        siblings = self._children[key]
        siblings.discard(page)
        if not siblings:
            del self._children[key]

    def forget(self, page: int) -> None:
        """Drop ``page``'s key: its KV is not what the key names (a disk load that failed
        on a rank), so it is no hit; freed, it is allocated first."""
        key = self.key[page]
        if key is None:
            return
        del self._cached[key]
        self.key[page] = None
        self._drop_held(page)
        if self.ref[page] == 0:
            self._free.move_to_end(page, last=False)

    def reset(self) -> bool:
        """Forget every cached key (the memory tier), if no page is in use; else False."""
        if len(self._free) != self.num_pages:
            return False
        self._cached.clear()
        self.key = [None] * self.num_pages
        self.held = [None] * self.num_pages
        self._children.clear()
        return True

    def check(self, holders: Iterable[Sequence[int]]) -> None:
        """Assert the pool's invariants given every running sequence's block table."""
        want = [0] * self.num_pages
        for table in holders:
            for p in table:
                want[p] += 1
        if want != self.ref:
            bad = [p for p in range(self.num_pages) if want[p] != self.ref[p]][:8]
            raise SchedulerError(
                f"page pool: ref counts disagree with block tables at pages {bad}: "
                f"refs {[self.ref[p] for p in bad]}, tables {[want[p] for p in bad]}"
            )
        free = {p for p in range(self.num_pages) if self.ref[p] == 0}
        if free != set(self._free):
            raise SchedulerError("page pool: the free list is not the set of unreferenced pages")
        for k, p in self._cached.items():
            if self.key[p] != k:
                raise SchedulerError(f"page pool: cached key of page {p} does not match")
        if sum(1 for k in self.key if k is not None) != len(self._cached):
            raise SchedulerError("page pool: a keyed page is missing from the cache map")
        by_parent = {p for pages in self._children.values() for p in pages}
        if by_parent != {p for p in range(self.num_pages) if self.held[p] is not None}:
            raise SchedulerError("page pool: the pages by parent are not the held pages")
        if any(self.key[p] is not None and self.held[p] is None for p in range(self.num_pages)):
            raise SchedulerError("page pool: a keyed page does not say what it holds")
