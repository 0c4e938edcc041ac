"""The parent side of domains: allocation transactions, fences, release, close.

Allocation is a transaction across ranks: every member records each step in its own
ledger as it succeeds; if any member fails, every member rolls back (the failing one
aborts the handshakes so the others stop waiting) and the caller gets one
DomainAllocationError naming each failed rank and its step. A domain is released
logically at ``release_domain`` and physically when its run's fence retires.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from phalanx.lifecycle import CleanupError, FailpointError
from phalanx.lifecycle.failpoints import Failpoint
from phalanx.lifecycle.ledger import Entry, Ledger, ResourceState
from phalanx.rendezvous import HandshakeAbortedError

from . import rank_ops
from ._errors import DomainAllocationError, DomainReleasedError, DomainSpecError
from .domain import Domain, DomainState
from .rank_state import DOMAIN_SLOTS
from .shm import SHM_DIR
from .spec import DomainSpec

if TYPE_CHECKING:
    from phalanx.runtime import Orchestrator

    from .worker import Worker

__all__ = ["DomainManager"]

log = logging.getLogger("phalanx.comm")

_VALIDATED = Failpoint("domain.alloc.validated", "parent: spec checked, id and slot reserved")
_BASE_BEGIN = Failpoint("base.init.begin", "parent: about to create the base communicator")
_MEMBERS_DONE = Failpoint("domain.alloc.members_done", "parent: every member allocated")
_LOGICAL = Failpoint("domain.release.logical", "parent: release_domain revokes the domain")
_PHYSICAL = Failpoint("domain.release.physical", "parent: the fence releases the domain")
_BASE_RELEASE = Failpoint("base.release.ranks", "parent: about to release the base on ranks")


def _root_causes(failures: dict[int, BaseException]) -> dict[int, BaseException]:
    """Ranks that failed on their own, not those that stopped because another aborted."""
    own = {r: e for r, e in failures.items() if not isinstance(e, HandshakeAbortedError)}
    return own or failures


def _describe(failures: Mapping[int, BaseException]) -> str:
    parts = []
    for r, e in sorted(failures.items()):
        step = f" at {e.point}" if isinstance(e, FailpointError) else ""
        parts.append(f"rank {r}{step}: {type(e).__name__}: {e}")
    return "; ".join(parts)


class DomainManager:
    def __init__(self, worker: Worker, timeout: float) -> None:
        self.worker = worker
        self.timeout = timeout
        self.ledger = Ledger("parent")
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._names: dict[str, Domain | None] = {}  # live names (None: being allocated)
        self._entries: dict[int, tuple[Domain, Entry]] = {}
        self._free_slots = list(range(DOMAIN_SLOTS - 1, -1, -1))
        self._base_lock = threading.Lock()
        self._base: Entry | None = None

    # -- allocation -------------------------------------------------------------------
    def allocate(self, o: Orchestrator, name: str, ranks: Sequence[int], window_size: int,
                 buffers: Sequence[tuple[str, int]], scratch_size: int) -> Domain:
        DomainSpec.validate(name, ranks, self.worker.ranks, window_size, buffers, scratch_size)
        with self._lock:
            if name in self._names:
                raise DomainSpecError(f"domain name {name!r} is in use by a live domain; "
                                      f"names are unique among live domains")
            if not self._free_slots:
                raise DomainSpecError(f"{DOMAIN_SLOTS} domains are live: release some first")
            self._names[name] = None
            spec = DomainSpec(next(self._ids), name, tuple(ranks), window_size,
                              tuple((str(b), int(n)) for b, n in buffers), scratch_size,
                              self._free_slots.pop(), self.worker.generation)
        entry = self.ledger.acquiring("domain", name, f"run {o.run_id}", retry_allowed=False)
        allocated = False
        try:
            _VALIDATED.hit()
            self._ensure_base(o)
            outcomes = self._on_members(o, spec, rank_ops.domain_alloc, spec, self.timeout)
            failures = {r: v for r, v in outcomes.items() if isinstance(v, BaseException)}
            if failures:
                self._purge(spec)
                causes = _root_causes(failures)
                raise DomainAllocationError(
                    f"allocating domain {name!r} (id {spec.alloc_id}, ranks {list(ranks)}) "
                    f"failed; every member rolled back. {_describe(causes)}", failures
                ) from next(iter(causes.values()))
            allocated = True
            _MEMBERS_DONE.hit()
        except BaseException:
            if allocated:  # members hold it: give it back through the normal release
                self._on_members(o, spec, rank_ops.domain_release, spec.alloc_id,
                                 list(spec.members), self.timeout)
            entry.abandon()
            with self._lock:
                self._names.pop(name, None)
                self._free_slots.append(spec.slot)
            raise
        domain = Domain(spec, o.run_id)
        entry.live(lambda: self._physical_release(domain), handle=domain)
        with self._lock:
            self._names[name] = domain
            self._entries[spec.alloc_id] = (domain, entry)
        o.defer(f"release domain {name!r} (id {spec.alloc_id})",
                lambda: self._release_at_fence(domain))
        return domain

    def _on_members(self, o: Orchestrator, spec: DomainSpec, fn: Any, *args: Any) -> dict[int, Any]:
        futures = {r: o.control(r, fn, *args) for r in spec.members}
        out: dict[int, Any] = {}
        for r, f in futures.items():
            try:
                out[r] = f.result()
            except Exception as exc:  # noqa: BLE001  collected per rank
                out[r] = exc
        return out

    def _purge(self, spec: DomainSpec) -> None:
        self._purge_ids(spec.alloc_id, list(spec.members))

    def _purge_ids(self, alloc_id: int, members: list[int]) -> None:
        # Markers or keys a failed handshake left: remove them now that nobody waits
        # (through the first member that can: any rank reaches the whole store).
        for r in members:
            outcome = self.worker.call_ranks([r], rank_ops.purge_handshakes, alloc_id,
                                             members)[r]
            if outcome.ok:
                return

    def _ensure_base(self, o: Orchestrator) -> None:
        """The base communicator: created by the first allocation, owned by the worker."""
        with self._base_lock:
            if self._base is not None:
                return
            _BASE_BEGIN.hit()
            attempt = next(self._ids)  # a fresh id: a failed attempt's markers never collide
            world = list(self.worker.ranks)
            futures = {r: o.control(r, rank_ops.base_init, attempt, world, self.timeout)
                       for r in world}
            failures: dict[int, BaseException] = {}
            for r, f in futures.items():
                try:
                    f.result()
                except Exception as exc:  # noqa: BLE001  collected per rank
                    failures[r] = exc
            if failures:
                self._purge_ids(attempt, world)  # what its aborted handshakes left
                causes = _root_causes(failures)
                raise DomainAllocationError(
                    f"creating the base communicator failed; every rank rolled back. "
                    f"{_describe(causes)}", failures) from next(iter(causes.values()))
            entry = self.ledger.acquiring("base communicator", "notify pools", "worker",
                                          shared=True)
            self._base = entry.live(self._release_base)

    # -- release ----------------------------------------------------------------------
    def release_logical(self, domain: Domain) -> None:
        """Revoke now (no new tasks may get it); the fence releases it physically."""
        if domain.state is DomainState.UNCERTAIN and domain.error is not None:
            raise domain.error  # the outcome of the one release, replayed
        if domain.state is not DomainState.LIVE:
            return
        _LOGICAL.hit()
        domain.state = DomainState.REVOKED

    def _release_at_fence(self, domain: Domain) -> None:
        _, entry = self._entries[domain.alloc_id]
        if domain.state is DomainState.LIVE:
            domain.state = DomainState.REVOKED  # forgotten by its orch: the fence releases it
        try:
            self.ledger.release(entry)
        except BaseException as exc:
            domain.state, domain.error = DomainState.UNCERTAIN, exc
            raise
        self._forget(domain)

    def _physical_release(self, domain: Domain) -> None:
        _PHYSICAL.hit()
        members = list(domain.members)
        outcomes = self.worker.call_ranks(members, rank_ops.domain_release, domain.alloc_id,
                                          members, self.timeout, timeout=self.timeout + 10)
        failures = {r: o.error for r, o in outcomes.items() if o.error is not None}
        if failures:
            raise CleanupError(
                f"releasing domain {domain.name!r} (id {domain.alloc_id}) failed on ranks "
                f"{sorted(failures)}; those resources stay owned (uncertain) and the worker "
                f"admits no new runs. {_describe(failures)}", list(failures.values()))

    def _forget(self, domain: Domain) -> None:
        domain.state = DomainState.RELEASED
        with self._lock:
            self._entries.pop(domain.alloc_id, None)
            self._names.pop(domain.name, None)
            self._free_slots.append(domain.spec.slot)

    def _release_base(self) -> None:
        _BASE_RELEASE.hit()
        alive = self.worker.alive_ranks()
        outcomes = self.worker.call_ranks(alive, rank_ops.base_release, timeout=self.timeout)
        failures = [o.error for o in outcomes.values() if o.error is not None]
        if failures:
            raise CleanupError("releasing the base communicator failed", failures)

    # -- close ------------------------------------------------------------------------
    def close(self) -> None:
        """Worker.close's step, while rank channels still work: finish every domain the
        fences could not (forced, no handshakes: the job is ending), then the base
        communicator, then any shared-memory name of this generation a dead rank left."""
        errors: list[Exception] = []
        alive = set(self.worker.alive_ranks())
        for domain, entry in list(self._entries.values()):
            members = [r for r in domain.members if r in alive]
            outcomes = self.worker.call_ranks(members, rank_ops.force_release, domain.alloc_id,
                                              timeout=self.timeout)
            failed = [o.error for o in outcomes.values() if o.error is not None]
            if failed:
                errors.extend(failed)
                continue
            self.ledger.resolve(entry)  # every member freed its half
            self._forget(domain)
        if not errors and self._base is not None:
            try:
                if self._base.state is ResourceState.UNCERTAIN:
                    self.ledger.retry_uncertain("worker")
                else:
                    self.ledger.release(self._base)
                self._base = None
            except Exception as exc:  # noqa: BLE001  reported below; the step stays owed
                errors.append(exc)
        errors.extend(self._unlink_leftover_names())
        if errors:
            raise CleanupError(f"worker {self.worker.generation}: domains left behind", errors)

    def _unlink_leftover_names(self) -> list[Exception]:
        prefix = f"phx-{self.worker.generation}-"
        errors: list[Exception] = []
        for name in sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix)):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                log.warning("worker %s: removed shared-memory name %s that a dead rank left",
                            self.worker.generation, name)
            except FileNotFoundError:
                continue
            except OSError as exc:
                errors.append(exc)
        return errors

    # -- inspection -------------------------------------------------------------------
    def live(self) -> list[Domain]:
        with self._lock:
            return [d for d in self._names.values() if d is not None]

    def check_usable(self, domain: Domain) -> None:
        if domain.state is not DomainState.LIVE:
            raise DomainReleasedError(f"domain {domain.name!r} is {domain.state.value}")
