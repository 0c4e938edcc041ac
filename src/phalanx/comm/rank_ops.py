"""The rank side of domain allocation and release: steps run by control tasks.

Every step records its resource in the rank's ledger as it succeeds; a failure rolls
back what this rank recorded (dependents first) and aborts the allocation's
handshakes, so the other members roll back promptly instead of waiting out a timeout.
Handshakes go through the job's rendezvous backend, the same on one host or many.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from phalanx.lifecycle import CleanupError
from phalanx.lifecycle.failpoints import Failpoint
from phalanx.lifecycle.ledger import Entry, ResourceState
from phalanx.rendezvous import HandshakeAbortedError, HandshakeTimeoutError, current

from . import shm
from ._errors import BaseNotReadyError
from .rank_state import (
    BASE_OWNER,
    HEADER_SLOT,
    POOL_BYTES,
    SLOT_WORDS,
    pool_name,
    rank_comm,
)
from .spec import DomainSpec, segment_name
from .view import DomainView, ShmPeer
from .waiting import Waited, wait_for

__all__ = ["base_init", "base_release", "domain_alloc", "domain_release", "force_release",
           "ledger_report", "purge_handshakes", "retry_uncertain"]

_F = Failpoint
_BASE_POOL_CREATED = _F("base.init.pool_created", "rank: notify pool segment created")
_BASE_POOL_MAPPED = _F("base.init.pool_mapped", "rank: own notify pool mapped")
_BASE_PEERS_MAPPED = _F("base.init.peers_mapped", "rank: every peer's notify pool mapped")
_BASE_POOL_UNLINKED = _F("base.init.pool_unlinked", "rank: own notify pool name unlinked")
_BASE_RELEASE = _F("base.release.begin", "rank: releasing the base communicator")
_BASE_POOL_UNMAP = _F("base.release.pool_unmap", "rank: about to unmap its own notify pool")
_BASE_PEER_UNMAP = _F("base.release.peer_pool_unmap", "rank: about to unmap a peer's pool")
_NAME_UNLINK = _F("domain.alloc.name_unlink", "rank: about to unlink its segment name")
_SEG_CREATED = _F("domain.alloc.segment_created", "rank: domain segment name created")
_WINDOW_MAPPED = _F("domain.alloc.window_mapped", "rank: own segment mapped")
_SLOT_BORROWED = _F("domain.alloc.slot_borrowed", "rank: notify slot borrowed and zeroed")
_CREATED = _F("domain.alloc.created", "rank: past the 'created' handshake")
_PEER_MAPPED = _F("domain.alloc.peer_mapped", "rank: one peer segment mapped")
_ATTACHED = _F("domain.alloc.attached", "rank: past the 'attached' handshake")
_NAME_UNLINKED = _F("domain.alloc.name_unlinked", "rank: own segment name unlinked")
_VIEW_REGISTERED = _F("domain.alloc.view_registered", "rank: view published to tasks")
_REVOKED = _F("domain.release.revoked", "rank: view revoked, before quiesce handshake")
_QUIESCED = _F("domain.release.quiesced", "rank: view revoked, peers about to be unmapped")
_PEER_UNMAP = _F("domain.release.peer_unmap", "rank: about to unmap a peer segment")
_WINDOW_UNMAP = _F("domain.release.window_unmap", "rank: about to unmap own segment")
_SLOT_RETURN = _F("domain.release.slot_return", "rank: about to return the notify slot")

ALLOC_TAGS = ("created", "attached")
BASE_TAGS = ("poolcreated", "poolmapped")  # base init's handshakes, via the backend
HANDSHAKE_TAGS = (*ALLOC_TAGS, *BASE_TAGS)  # every tag of an allocation
PHASE_CREATED, PHASE_ATTACHED = 1, 2
_PHASE_ABORT = 0xFF


def pool_handshake(spec: DomainSpec, phase: int, timeout: float) -> None:
    """A handshake among same-host members through the base communicator's notify pool.

    Each member writes ``alloc_id << 8 | phase`` into word 1 of the domain's slot in its
    own pool (a single writer per word) and waits until every member's word reaches it.
    Words are tagged with the allocation id, which only grows, so a word left by the
    slot's previous domain can never satisfy this one and slots never need zeroing;
    ``phase`` 0xFF is an abort. Nothing is created, so nothing is left to remove.
    (Members on other hosts would meet through the job's rendezvous backend instead.)
    """
    st = rank_comm()
    word = spec.slot * SLOT_WORDS + 1
    target = spec.alloc_id << 8 | phase
    st.flags[st.rank][word] = target
    deadline = time.monotonic() + timeout
    aborted = spec.alloc_id << 8 | _PHASE_ABORT
    for r in spec.members:
        flags = st.flags[r]
        waited = wait_for(partial(_word_reached, flags, word, target), st.pids[r], deadline)
        if int(flags[word]) == aborted:
            raise HandshakeAbortedError(
                f"domain {spec.name!r} (id {spec.alloc_id}) phase {phase}: rank {st.rank} "
                f"stopped waiting because rank {r} aborted the allocation")
        if waited is Waited.DEAD:
            raise HandshakeTimeoutError(
                f"domain {spec.name!r} (id {spec.alloc_id}) phase {phase}: rank {st.rank} "
                f"stopped waiting: rank {r} (pid {st.pids[r]}) is dead", [r])
        if waited is Waited.TIMEOUT:
            late = [m for m in spec.members if int(st.flags[m][word]) < target]
            raise HandshakeTimeoutError(
                f"domain {spec.name!r} (id {spec.alloc_id}): rank {st.rank} waited "
                f"{timeout:g}s at phase {phase}; ranks {late} never arrived", late)


def _word_reached(flags: np.ndarray, word: int, target: int) -> bool:
    return int(flags[word]) >= target


def _abort_pool_handshakes(spec: DomainSpec) -> None:
    st = rank_comm()
    if st.rank in st.flags:
        st.flags[st.rank][spec.slot * SLOT_WORDS + 1] = spec.alloc_id << 8 | _PHASE_ABORT


def _owner(alloc_id: int) -> str:
    return f"domain {alloc_id}"


def _flags(mem: Any) -> np.ndarray:
    return np.frombuffer(mem, dtype=np.uint64)


# -- base communicator ----------------------------------------------------------------
def base_init(attempt_id: int, world: list[int], timeout: float) -> None:
    """Create this rank's notify pool and map every rank's (all ranks take part)."""
    st = rank_comm()
    if st.base_ready:
        return
    name = pool_name(st.generation, st.rank)
    try:
        name_entry = st.ledger.acquiring("notify pool name", name, BASE_OWNER, shared=True)
        fd = shm.create_segment(name, POOL_BYTES)
        name_entry.live(lambda: shm.unlink_segment(name))
        _BASE_POOL_CREATED.hit()
        map_entry = st.ledger.acquiring("notify pool mapping", name, BASE_OWNER, shared=True)
        pool = shm.map_fd(fd, POOL_BYTES)
        map_entry.live(_step(_BASE_POOL_UNMAP, pool.close), handle=pool)
        _flags(pool)[HEADER_SLOT * SLOT_WORDS] = os.getpid()
        _BASE_POOL_MAPPED.hit()
        current.handshake("poolcreated", attempt_id, world, timeout)
        peers: dict[int, Any] = {st.rank: pool}
        for r in world:
            if r == st.rank:
                continue
            peer_name = pool_name(st.generation, r)
            e = st.ledger.acquiring("peer notify pool mapping", peer_name, BASE_OWNER,
                                    shared=True)
            mm = shm.map_fd(shm.open_segment(peer_name), POOL_BYTES)
            e.live(_step(_BASE_PEER_UNMAP, mm.close), handle=mm)
            peers[r] = mm
        _BASE_PEERS_MAPPED.hit()
        current.handshake("poolmapped", attempt_id, world, timeout)
        st.ledger.release(name_entry)  # every rank mapped it: no name outlives this step
        _BASE_POOL_UNLINKED.hit()
    except BaseException as exc:
        _rollback(attempt_id, BASE_OWNER, exc, abort_among=world)
        raise
    st.pool, st.pool_entry = pool, map_entry
    st.flags = {r: _flags(mm) for r, mm in peers.items()}
    st.pids = {r: int(f[HEADER_SLOT * SLOT_WORDS]) for r, f in st.flags.items()}


def base_release() -> None:
    """Release the base communicator (Worker.close, after every domain is gone)."""
    st = rank_comm()
    _BASE_RELEASE.hit()
    st.ledger.retry_uncertain(BASE_OWNER)
    st.flags = {}  # drop our numpy views first: the mappings cannot close under them
    st.pool = None
    st.ledger.release_owner(BASE_OWNER)
    st.pool_entry = None


# -- domains --------------------------------------------------------------------------
def domain_alloc(spec: DomainSpec, timeout: float) -> None:
    st = rank_comm()
    owner = _owner(spec.alloc_id)
    members = list(spec.members)
    try:
        if not st.base_ready or st.pool_entry is None:
            raise BaseNotReadyError(f"rank {st.rank}: allocating domain {spec.name!r} (id "
                                    f"{spec.alloc_id}) needs the base communicator, which is "
                                    f"not initialised on this rank")
        name = segment_name(spec.generation, spec.alloc_id, st.rank)
        name_entry = st.ledger.acquiring("segment name", name, owner)
        fd = shm.create_segment(name, spec.segment_size)
        name_entry.live(_step(_NAME_UNLINK, lambda: shm.unlink_segment(name)))
        _SEG_CREATED.hit()
        own_entry = st.ledger.acquiring("segment mapping", name, owner)
        own = shm.map_fd(fd, spec.segment_size)
        own_entry.live(_step(_WINDOW_UNMAP, own.close), handle=own)
        _WINDOW_MAPPED.hit()
        own_flags = st.flags[st.rank]
        slot_entry = st.ledger.acquiring("notify slot borrow", f"slot {spec.slot}", owner,
                                         depends_on=[st.pool_entry])
        slot_entry.live(_SLOT_RETURN.hit)  # words are tagged with the alloc id: no zeroing
        _SLOT_BORROWED.hit()
        pool_handshake(spec, PHASE_CREATED, timeout)
        _CREATED.hit()
        mappings: dict[int, Entry] = {}
        for r in members:
            if r == st.rank:
                continue
            peer = segment_name(spec.generation, spec.alloc_id, r)
            e = st.ledger.acquiring("peer segment mapping", peer, owner)
            mm = shm.map_fd(shm.open_segment(peer), spec.segment_size)
            e.live(_step(_PEER_UNMAP, mm.close), handle=mm)
            mappings[r] = e
            _PEER_MAPPED.hit()
        pool_handshake(spec, PHASE_ATTACHED, timeout)
        _ATTACHED.hit()
        st.ledger.release(name_entry)  # every member mapped it: SIGKILL now leaves nothing
        _NAME_UNLINKED.hit()
        peers = {spec.members.index(r): ShmPeer(e.handle, spec, st.flags[r], st.pids[r])
                 for r, e in mappings.items()}
        peers[spec.members.index(st.rank)] = ShmPeer(own, spec, own_flags, os.getpid())
        view = DomainView(spec, st.rank, peers, own_flags, timeout)
        view_entry = st.ledger.acquiring(
            "domain view", spec.name, owner,
            depends_on=[own_entry, slot_entry, *mappings.values()])
        st.views[spec.alloc_id] = view
        view_entry.live(lambda: _drop_view(spec.alloc_id), handle=view)
        _VIEW_REGISTERED.hit()
    except BaseException as exc:
        _abort_pool_handshakes(spec)
        _rollback(spec.alloc_id, owner, exc)
        raise


def _step(point: Failpoint, release: Callable[[], None]) -> Callable[[], None]:
    """A release step with its failpoint inside it: an injected fault is a failed release
    (the resource turns uncertain), exactly like a real one."""

    def run() -> None:
        point.hit()
        release()

    return run


def _drop_view(alloc_id: int) -> None:
    _REVOKED.hit()
    view = rank_comm().views.pop(alloc_id, None)
    if isinstance(view, DomainView):
        view.revoke()


def _rollback(alloc_id: int, owner: str, exc: BaseException,
              abort_among: Sequence[int] = ()) -> None:
    """Tell the other members (``abort_among``, when they wait in rendezvous handshakes)
    to stop waiting, then undo what this rank recorded."""
    if abort_among:
        try:
            current.backend().abort(alloc_id, rank_comm().rank, BASE_TAGS, abort_among)
        except Exception as err:  # noqa: BLE001  a courtesy; timeouts still bound peers
            exc.add_note(f"rank {rank_comm().rank} could not abort allocation {alloc_id}: "
                         f"{err!r}")
    try:
        rank_comm().ledger.release_owner(owner)
    except CleanupError as cleanup:
        exc.add_note(f"rolling back {owner} on rank {rank_comm().rank} left uncertain "
                     f"resources: {cleanup!r}")


def domain_release(alloc_id: int, members: list[int], timeout: float) -> None:
    """Stop, drop peer references, then unmap and free.

    Quiescence: the parent sends this only after the run's fence passed, i.e. after
    every member reported every task of the run done; that report, gathered by the
    parent, is the members' agreement that the domain is quiet. For same-host members
    nothing else is needed: a mapping keeps its memory alive, so no member's unmap can
    pull memory from under another, and no name is left to unlink. (Cross-host members,
    whose windows would be registered with a NIC, will meet at a 'quiesced' handshake
    through the rendezvous backend before unregistering.)

    A failed step does not stop the others: it is collected, its resource stays
    uncertain, and every failure is raised together at the end.
    """
    st = rank_comm()
    owner = _owner(alloc_id)
    errors: list[Exception] = []
    for kinds in (("domain view",), ("peer segment mapping",)):
        for e in st.ledger.entries(owner):
            if e.kind in kinds and e.state is ResourceState.LIVE:
                try:
                    st.ledger.release(e)
                except Exception as exc:  # noqa: BLE001  collected; raised below
                    errors.append(exc)
        if kinds == ("domain view",):
            _QUIESCED.hit()
    try:
        st.ledger.release_owner(owner)
    except CleanupError as exc:
        errors.extend(exc.exceptions)
    if errors:
        raise CleanupError(f"rank {st.rank}: releasing domain {alloc_id} failed", errors)


def purge_handshakes(alloc_id: int, members: Sequence[int]) -> int:
    """Remove what failed handshakes of ``alloc_id`` left behind (nobody waits any more)."""
    return current.backend().purge(alloc_id, HANDSHAKE_TAGS, members)


def force_release(alloc_id: int) -> None:
    """Close-time release of this rank's half of a domain, without handshakes: the fence
    could not finish it (a peer died, a step failed). Retries uncertain steps once."""
    st = rank_comm()
    owner = _owner(alloc_id)
    st.ledger.retry_uncertain(owner)
    st.ledger.release_owner(owner)


def retry_uncertain() -> None:
    rank_comm().ledger.retry_uncertain()


def ledger_report() -> dict[str, Any]:
    """This rank's ledger: stats and the event log (tests read release order from it)."""
    st = rank_comm()
    return {"stats": st.ledger.stats(),
            "events": [(e.seq, e.what, e.rid, e.kind, e.name, e.owner, list(e.depends_on))
                       for e in st.ledger.events()],
            "entries": [(e.rid, e.kind, e.owner, list(e.depends_on)) for e in
                        st.ledger.entries()],
            "views": sorted(st.views)}
