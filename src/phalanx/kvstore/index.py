"""The in-memory index: a trie of page keys, the records (spans) that hold bytes, and
the candidate sets maintenance decides from. No I/O here.

A *node* is one page-aligned prefix (a key of the hash chain). A *record* is a node
where a written span ends; its file holds the KV of pages ``start .. end-1``. A node's
``covers`` lists the ready (unthinned) records whose span includes it, so the bytes of
page p of a prefix are a byte range of any record in ``covers`` of p's node.

Invariants (checked by ``problems()``, which ``DiskStore.check()`` calls):
  I1  every node in the trie has at least one cover: a cached prefix is loadable, and
      lookup() is the longest chain of present nodes;
  I2  a record is in ``covers`` of exactly the nodes of its span iff it is not thinned;
  I3  ``bytes`` == the file lengths of attached records plus orphans;
  I4  heaps and candidate sets hold only keys of records (stale entries are filtered
      on pop, and the heaps are rebuilt when they outgrow the index).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from operator import attrgetter

from .keys import ROOT_KEY

__all__ = ["Index", "Node", "Record"]


class Record:
    __slots__ = (
        "created", "end", "file_len", "key", "last_used", "node", "parent",
        "pins", "row_len", "start", "thinned", "verified",
    )

    def __init__(self, key: bytes, parent: bytes, start: int, end: int, row_len: int,
                 file_len: int, created: float, thinned: bool, verified: bool) -> None:
        self.key = key
        self.parent = parent  # key of the node before this span (ROOT_KEY at page 0)
        self.start = start
        self.end = end
        self.row_len = row_len
        self.file_len = file_len
        self.created = created  # wall-clock seconds, from the header: expiry
        self.last_used = 0  # logical clock: LRU
        self.thinned = thinned
        self.verified = verified  # row CRCs known good in this process (written here)
        self.pins = 0  # loads in flight; maintenance defers jobs on pinned records
        self.node: Node | None = None


class Node:
    __slots__ = ("children", "covers", "depth", "key", "parent", "record")

    def __init__(self, key: bytes, parent: Node | None, depth: int) -> None:
        self.key = key
        self.parent = parent
        self.depth = depth  # pages from the root; the root is 0
        self.children: dict[bytes, Node] = {}
        self.covers: list[Record] = []
        self.record: Record | None = None


class Index:
    def __init__(self) -> None:
        self.root = Node(ROOT_KEY, None, 0)
        self.nodes: dict[bytes, Node] = {}
        self.records: dict[bytes, Record] = {}  # attached records
        self.orphans: dict[bytes, Record] = {}  # detached: unreachable, files to drop
        self.thin_candidates: dict[bytes, None] = {}  # insertion-ordered set
        self.bytes = 0
        self.changes = 0  # mutations (attach, thin, remove, forget): snapshot staleness
        self._clock = itertools.count(1)
        self._lru: list[tuple[int, bytes]] = []  # (last_used, key) of leaf candidates
        self._age: list[tuple[float, bytes]] = []  # (created, key) of leaf candidates

    # -- lookup ------------------------------------------------------------------
    def cached_pages(self, keys: list[bytes]) -> int:
        """Pages of the longest cached prefix of ``keys``.

        A key names its whole prefix (the parent is hashed into it) and the trie is
        prefix-closed, so presence of key i implies keys 0..i: binary search, O(log n)
        map lookups instead of a walk.
        """
        lo, hi = 0, len(keys)  # invariant: keys[:lo] cached, keys[hi:] not
        while lo < hi:
            mid = (lo + hi) // 2
            node = self.nodes.get(keys[mid])
            if node is not None and node.depth == mid + 1:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def has_prefix(self, keys: list[bytes], n: int) -> bool:
        """Pages 0..n-1 of ``keys`` are cached (``cached_pages(keys) >= n``, for n <=
        len(keys)): one map lookup, as a key names its whole prefix."""
        node = self.nodes.get(keys[n - 1]) if 0 < n <= len(keys) else None
        return node is not None and node.depth == n

    def plan(self, keys: list[bytes], n: int) -> list[tuple[Record, int, int]]:
        """Pieces (record, first page, end page) that assemble cached pages 0..n-1.

        From the end backwards, each piece comes from the cover that starts earliest,
        so a prefix inside one span is one read.
        """
        pieces: list[tuple[Record, int, int]] = []
        i = n
        while i > 0:
            covers = self.nodes[keys[i - 1]].covers
            rec = covers[0] if len(covers) == 1 else min(covers, key=_start)
            pieces.append((rec, rec.start, i))
            i = rec.start
        pieces.reverse()
        return pieces

    def touch(self, rec: Record) -> None:
        self.touch_all([rec])

    def touch_all(self, recs: list[Record]) -> None:
        """Mark ``recs`` used now, in order (the last is the most recent)."""
        clock, lru, is_leaf, push = self._clock, self._lru, self.is_leaf, heapq.heappush
        for rec in recs:
            rec.last_used = used = next(clock)
            if is_leaf(rec):
                push(lru, (used, rec.key))
        if len(lru) > 2 * len(self.records) + 1024:
            self._compact()  # a cache that never fills up never runs lru_leaf

    # -- mutation ----------------------------------------------------------------
    def add(self, rec: Record, keys: list[bytes], parent: Node, recovering: bool = False) -> None:
        """Attach ``rec`` whose span pages have ``keys``, below ``parent`` (depth start).

        ``recovering``: a bulk build that ends with ``reseed()``, which sets LRU order
        and the heaps for every record at once; skip them here.
        """
        self.changes += 1
        node = parent
        path: list[Node] = []
        for k in keys:
            nxt = node.children.get(k)
            if nxt is None:
                nxt = Node(k, node, node.depth + 1)
                node.children[k] = nxt
                self.nodes[k] = nxt
            path.append(nxt)
            node = nxt
        rec.node = node
        node.record = rec
        self.records[rec.key] = rec
        self.bytes += rec.file_len
        if not rec.thinned:
            for n in path:
                n.covers.append(rec)
                older = n.record
                # an earlier record ending inside this span, starting no earlier: all of
                # its bytes are now in this row too, so it can be thinned
                if older is not None and older is not rec and not older.thinned and (
                    older.start >= rec.start
                ):
                    self.thin_candidates[older.key] = None
        if recovering:
            return
        self.touch(rec)
        heapq.heappush(self._age, (rec.created, rec.key))

    def attach_interior(self, rec: Record, keys: list[bytes], parent: Node) -> bool:
        """Attach a thinned record at recovery; False when its nodes are not all cached."""
        node = parent
        for k in keys:
            nxt = node.children.get(k)
            if nxt is None:
                return False
            node = nxt
        if node.record is not None:
            return False
        self.changes += 1
        rec.node = node
        node.record = rec
        self.records[rec.key] = rec
        self.bytes += rec.file_len
        rec.last_used = next(self._clock)
        return True

    def span_nodes(self, rec: Record) -> list[Node]:
        assert rec.node is not None
        out: list[Node] = []
        node: Node | None = rec.node
        for _ in range(rec.end - rec.start):
            assert node is not None
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def thin(self, rec: Record, new_file_len: int) -> None:
        self.changes += 1
        for n in self.span_nodes(rec):
            n.covers.remove(rec)
        rec.thinned = True
        self.bytes += new_file_len - rec.file_len
        rec.file_len = new_file_len
        rec.row_len = 0
        self.thin_candidates.pop(rec.key, None)

    def remove(self, rec: Record) -> list[Record]:
        """Detach ``rec`` (a leaf) and whatever it alone made reachable.

        Returns the records that became unreachable (now orphans whose files must be
        dropped). ``rec`` itself becomes an orphan until its file is gone.
        """
        self.changes += 1
        path = self.span_nodes(rec)
        if not rec.thinned:
            for n in path:
                n.covers.remove(rec)
        assert rec.node is not None
        rec.node.record = None
        del self.records[rec.key]
        self.orphans[rec.key] = rec
        self.thin_candidates.pop(rec.key, None)
        top = next((n for n in path if not n.covers), None)
        if top is None:
            return []
        # I1: a node nobody covers is detached with its subtree; spans ending below it
        # start below it (else they would cover it), so nothing above is affected.
        parent = top.parent
        assert parent is not None
        del parent.children[top.key]
        lost: list[Record] = []
        for n in _subtree(top):
            del self.nodes[n.key]
            if n.record is not None:
                r = n.record
                del self.records[r.key]
                self.orphans[r.key] = r
                self.thin_candidates.pop(r.key, None)
                lost.append(r)
                n.record = None
        # whoever held the detached branch's prefix may be removable now
        for r in {*parent.covers, *([parent.record] if parent.record else [])}:
            if self.is_leaf(r):
                self._push_leaf(r)
        return lost

    def forget_orphan(self, key: bytes) -> Record | None:
        rec = self.orphans.pop(key, None)
        if rec is not None:
            self.changes += 1
            self.bytes -= rec.file_len
        return rec

    def add_orphan(self, rec: Record) -> None:
        self.changes += 1
        self.orphans[rec.key] = rec
        self.bytes += rec.file_len

    # -- candidates ----------------------------------------------------------------
    def is_leaf(self, rec: Record) -> bool:
        """Removable without orphaning anyone: no prefix below depends on its bytes.

        Its end node has no children, and no node of its span that only it covers has
        a branch hanging off it (a suffix row stored after a shared prefix of this row
        depends on this row: removing it would orphan that branch).
        """
        node = rec.node
        if node is None or rec.thinned or node.children or self.records.get(rec.key) is not rec:
            return False
        for _ in range(rec.end - rec.start - 1):
            node = node.parent
            assert node is not None
            if len(node.children) > 1 and len(node.covers) == 1:
                return False
        return True

    def is_thinnable(self, rec: Record) -> bool:
        if rec.thinned or rec.node is None or self.records.get(rec.key) is not rec:
            return False
        return any(c is not rec and c.start <= rec.start for c in rec.node.covers)

    def _push_leaf(self, rec: Record) -> None:
        heapq.heappush(self._lru, (rec.last_used, rec.key))
        heapq.heappush(self._age, (rec.created, rec.key))

    def lru_leaf(self) -> Record | None:
        """The least recently used unpinned leaf, or None."""
        skipped: list[tuple[int, bytes]] = []
        found: Record | None = None
        while self._lru:
            used, key = self._lru[0]
            rec = self.records.get(key)
            if rec is None or rec.last_used != used or not self.is_leaf(rec):
                heapq.heappop(self._lru)
                continue
            if rec.pins:
                skipped.append(heapq.heappop(self._lru))
                continue
            found = rec
            break
        for item in skipped:
            heapq.heappush(self._lru, item)
        self._compact()
        return found

    def expired_leaf(self, cutoff: float) -> Record | None:
        """An unpinned leaf created before ``cutoff``, or None."""
        skipped: list[tuple[float, bytes]] = []
        found: Record | None = None
        while self._age and self._age[0][0] < cutoff:
            _, key = self._age[0]
            rec = self.records.get(key)
            if rec is None or not self.is_leaf(rec):
                # not a leaf now: pushed again when its last child goes
                heapq.heappop(self._age)
                continue
            if rec.pins:
                skipped.append(heapq.heappop(self._age))
                continue
            found = rec
            break
        for item in skipped:
            heapq.heappush(self._age, item)
        return found

    def reseed(self) -> None:
        """After recovery: LRU order = creation order; rebuild heaps and thin candidates."""
        clock = self._clock
        for rec in sorted(self.records.values(), key=attrgetter("created")):
            rec.last_used = next(clock)
        lru: list[tuple[int, bytes]] = []
        age: list[tuple[float, bytes]] = []
        is_leaf, is_thinnable, thin = self.is_leaf, self.is_thinnable, self.thin_candidates
        for rec in self.records.values():
            node = rec.node
            if rec.thinned or node is None:
                continue  # neither a leaf nor thinnable
            # fast paths of is_leaf / is_thinnable for the common one-page, one-cover case
            if not node.children and (rec.end - rec.start == 1 or is_leaf(rec)):
                lru.append((rec.last_used, rec.key))
                age.append((rec.created, rec.key))
            if len(node.covers) > 1 and is_thinnable(rec):
                thin[rec.key] = None
        heapq.heapify(lru)
        heapq.heapify(age)
        self._lru, self._age = lru, age

    def _compact(self) -> None:
        # I4: touches push fresh entries; rebuild so the heap stays bounded by the index
        if len(self._lru) > 2 * len(self.records) + 1024:
            self._lru = [(r.last_used, r.key) for r in self.records.values() if self.is_leaf(r)]
            heapq.heapify(self._lru)
        if len(self._age) > 2 * len(self.records) + 1024:
            self._age = [(r.created, r.key) for r in self.records.values() if self.is_leaf(r)]
            heapq.heapify(self._age)

    # -- audit -----------------------------------------------------------------------
    def problems(self) -> list[str]:
        out: list[str] = []
        seen = 0
        total = sum(r.file_len for r in self.records.values()) + sum(
            r.file_len for r in self.orphans.values()
        )
        if total != self.bytes:
            out.append(f"I3: index counts {self.bytes} bytes, records sum to {total}")
        for n in _subtree(self.root):
            if n is self.root:
                continue
            seen += 1
            if self.nodes.get(n.key) is not n:
                out.append(f"node {n.key.hex()} missing from the key map")
            if not n.covers:
                out.append(f"I1: node {n.key.hex()} at page {n.depth} has no cover")
            for c in n.covers:
                if c.thinned or not (c.start < n.depth <= c.end):
                    out.append(f"I2: node {n.key.hex()} lists a cover {c.key.hex()} "
                               f"that does not hold page {n.depth}")
            if n.record is not None and self.records.get(n.record.key) is not n.record:
                out.append(f"record {n.record.key.hex()} at a node but not in the index")
        if seen != len(self.nodes):
            out.append(f"{len(self.nodes)} nodes mapped, {seen} reachable")
        for rec in self.records.values():
            if rec.node is None or rec.node.record is not rec or rec.node.depth != rec.end:
                out.append(f"record {rec.key.hex()} is not at its end node")
                continue
            held = sum(1 for n in self.span_nodes(rec) if rec in n.covers)
            want = 0 if rec.thinned else rec.end - rec.start
            if held != want:
                out.append(f"I2: record {rec.key.hex()} covers {held} nodes, not {want}")
        return out


def _subtree(top: Node) -> Iterator[Node]:
    stack = [top]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children.values())


def _start(rec: Record) -> int:
    return rec.start
