"""Several hosts meet: node 0 hosts a c10d ``TCPStore``, every node registers with it.

Only torch's public ``TCPStore`` API is used (``set``, ``get``, ``wait``,
``compare_set``, ``check``, ``delete_key``, ``num_keys``), imported inside the functions
so that importing phalanx never imports torch. The store has no authentication, so the
frames carry HMAC proofs of the job token (:mod:`phalanx.hosts.frames`); the token itself
never crosses the network.

The protocol, all keys under ``phx/hosts/``:

1. node 0 creates the store on master-addr:master-port and sets ``nonce`` (16 fresh
   random bytes);
2. node R connects (retrying until its deadline: node 0 may start later), waits for
   ``nonce``, and claims ``join/R`` with ``compare_set`` (so two nodes started with the
   same rank are told so, naming the other's address), a :class:`JoinFrame` with its
   address and proof;
3. node 0 reads each join as it comes (``wait`` on the lowest rank still missing, then
   ``check`` for the others) and checks version, rank, nnodes and the proof (the join
   stays until the end, so a duplicate rank finds it taken);
4. node 0 writes every node's ``verdict/R``: admitted with the peers (signed), or why
   not. A wrong token is refused at once (the node and the others are told, all fail);
   at the deadline, the nodes that never came are named to every node that did;
5. node R reads its verdict, deletes it, sets ``ack/R``; node 0 waits for every ack
   (bounded), deletes the joins, the acks and the nonce. No key of the rendezvous is left: the
   store's key count is back to zero (``Membership.store_keys_after`` on node 0).

Invariant: every key is deleted by the one node that reads it last (a verdict by its
node; a join, an ack and the nonce by node 0 at the end); node 0's failure path deletes
every key a node that never came would have read. At most 3 keys a node plus the nonce
exist at any time.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, NoReturn

from phalanx.rendezvous import HandshakeTimeoutError, RendezvousError, TokenMismatchError

from .frames import (
    VERSION,
    JoinFrame,
    Peer,
    VerdictFrame,
    decode_join,
    decode_verdict,
    encode,
    sign_join,
    sign_verdict,
    valid_join,
    valid_verdict,
)

__all__ = ["Membership", "NodeSpec", "local_addr_towards", "rendezvous"]

_PREFIX = "phx/hosts"
_NONCE = f"{_PREFIX}/nonce"
_GRACE_S = 5.0  # for acks, and the margin a node waits beyond node 0's deadline
_CONNECT_ATTEMPT_S = 1.0  # one connect attempt of a node (torch overshoots it: _connect)


def _join(r: int) -> str:
    return f"{_PREFIX}/join/{r}"


def _verdict(r: int) -> str:
    return f"{_PREFIX}/verdict/{r}"


def _ack(r: int) -> str:
    return f"{_PREFIX}/ack/{r}"


@dataclass(frozen=True)
class NodeSpec:
    """One node's view of the job, as ``--nnodes/--node-rank/--master-addr/-port`` say."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    token: str
    addr: str | None = None  # advertised to the peers; None: the address facing the master
    timeout: float = 60.0  # for the whole rendezvous
    port: int = 0  # this node's control port, told to the peers (node 0's: the agents')

    def __post_init__(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node rank {self.node_rank} of {self.nnodes} nodes: the rank "
                             f"must be in 0..nnodes-1")
        if not self.token:
            raise ValueError("an empty job token: set PHALANX_JOB_TOKEN on every host")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master port {self.master_port} is not a TCP port")
        if self.timeout <= 0:
            raise ValueError(f"rendezvous timeout {self.timeout} must be positive")

    @property
    def master(self) -> str:
        return f"{self.master_addr}:{self.master_port}"


@dataclass(frozen=True)
class Membership:
    """The job as node 0 admitted it: every node's rank, address and pid."""

    nnodes: int
    node_rank: int
    master: str
    peers: tuple[Peer, ...]
    store_keys_after: int | None  # node 0: keys left in the store at the end (0); else None
    # node 0 with keep_store: the store itself, open for torch.distributed's groups (the
    # server stops when the last reference goes); else None
    store: Any = field(default=None, repr=False, compare=False)


def local_addr_towards(host: str, port: int) -> str:
    """This host's address on the route to ``host`` (a UDP connect sends nothing)."""
    family, kind, proto, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as s:
        s.connect(where)
        return str(s.getsockname()[0])


def _first_line(exc: BaseException) -> str:
    """torch's store errors carry a C++ trace after the first line."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def rendezvous(spec: NodeSpec, *, keep_store: bool = False) -> Membership:
    """Meet the other nodes (node 0 hosts the store); raise naming who failed and why.

    ``TokenMismatchError``: a node's proof of the token failed (named with its address,
    on node 0 and on that node; the others are told it was refused). ``HandshakeTimeoutError``
    (``.missing``: node ranks): not every node arrived within ``spec.timeout``.
    ``RendezvousError``: anything else (the store unreachable, a bad frame, a rank taken).
    ``keep_store`` (node 0): the store stays open in ``Membership.store``."""
    addr = spec.addr or local_addr_towards(spec.master_addr, spec.master_port)
    if spec.node_rank == 0:
        return _Leader(spec, addr).run(keep_store)
    return _follow(spec, addr)


# -- node 0 ----------------------------------------------------------------------------


class _Refusal(Exception):
    """Node 0 stops the rendezvous: the error it raises and the verdict the others get."""

    def __init__(self, error: RendezvousError, code: str, missing: list[int]) -> None:
        super().__init__(str(error))
        self.error, self.code, self.missing = error, code, missing


class _Leader:
    def __init__(self, spec: NodeSpec, addr: str) -> None:
        self.spec, self.addr = spec, addr
        self.deadline = time.monotonic() + spec.timeout
        self.nonce = os.urandom(16)
        self.joined: dict[int, JoinFrame] = {}
        self.verdicted: set[int] = set()  # ranks whose verdict is written
        self.read: set[int] = set()  # ranks whose join was read: each owes an ack

    def run(self, keep_store: bool) -> Membership:
        from torch.distributed import DistError, TCPStore  # type: ignore[attr-defined]

        spec = self.spec
        try:  # Any: as in _follow
            store: Any = TCPStore(spec.master_addr, spec.master_port, None, True,
                             timedelta(seconds=spec.timeout), wait_for_workers=False,
                             use_libuv=True)
        except DistError as exc:
            raise RendezvousError(f"node 0 could not host the store at {spec.master}: "
                                  f"{_first_line(exc)}") from exc
        try:
            membership = self._meet(store)
            return replace(membership, store=store) if keep_store else membership
        except DistError as exc:
            raise RendezvousError(f"node 0: the store at {spec.master} failed mid-rendezvous: "
                                  f"{_first_line(exc)}") from exc
        finally:
            del store  # the last reference: the server stops

    def _meet(self, store: Any) -> Membership:
        spec = self.spec
        own = JoinFrame(VERSION, 0, spec.nnodes, self.addr, os.getpid(), spec.port)
        self.joined[0] = own
        store.set(_NONCE, self.nonce)
        try:
            self._collect(store)
        except _Refusal as refusal:
            self._finish(store, refusal.code, str(refusal), refusal.missing)
            raise refusal.error from None
        peers = [Peer(r, f.addr, f.pid, f.port) for r, f in sorted(self.joined.items())]
        self._finish(store, "admitted", "", [], peers)
        return Membership(spec.nnodes, 0, spec.master, tuple(peers), int(store.num_keys()))

    def _collect(self, store: Any) -> None:
        """Read every join; raise _Refusal at the first bad one or at the deadline."""
        from torch.distributed import DistStoreError

        pending = set(range(1, self.spec.nnodes))
        while pending:
            for r in sorted(pending):
                if store.check([_join(r)]):
                    self._admit(store, r)
                    pending.discard(r)
            if not pending:
                return
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise self._missing(sorted(pending))
            try:  # woken by the lowest missing rank; the others are checked after it
                store.wait([_join(min(pending))], timedelta(seconds=max(0.001, remaining)))
            except DistStoreError:
                continue  # its deadline: the loop checks the others once more, then names

    def _admit(self, store: Any, r: int) -> None:
        spec, what = self.spec, f"node {r}'s join frame"
        # join/R stays until the end: a second node started with rank R then finds it
        # taken (compare_set) instead of claiming it again and reading R's verdict
        data = bytes(store.get(_join(r)))
        self.read.add(r)
        try:
            frame = decode_join(data, what)
        except RendezvousError as exc:
            self._refuse(store, r, "refused", f"node 0 at {spec.master} refused node {r}: {exc}")
        where = f"node {r} at {frame.addr} (pid {frame.pid})"
        if not valid_join(spec.token, self.nonce, frame):
            self._refuse(store, r, "wrong_token",
                         f"node 0 at {spec.master} refused {where}: its proof does not match "
                         f"this job's token. Check PHALANX_JOB_TOKEN on {frame.addr}")
        if frame.node_rank != r or frame.nnodes != spec.nnodes:
            self._refuse(store, r, "refused",
                         f"node 0 at {spec.master} refused {where}: it says node rank "
                         f"{frame.node_rank} of {frame.nnodes} nodes; this job has "
                         f"{spec.nnodes}. Check --nnodes and --node-rank on {frame.addr}")
        self.joined[r] = frame

    def _refuse(self, store: Any, r: int, code: str, reason: str) -> NoReturn:
        """Tell node r why, then stop everyone (raises)."""
        self._write(store, r, code, reason, [], [])
        error: RendezvousError = (TokenMismatchError(reason) if code == "wrong_token"
                                  else RendezvousError(reason))
        raise _Refusal(error, "aborted", [])

    def _missing(self, missing: list[int]) -> _Refusal:
        came = ", ".join(f"{r} at {f.addr}" for r, f in sorted(self.joined.items()))
        text = (f"rendezvous of {self.spec.nnodes} nodes at master {self.spec.master}: node "
                f"rank(s) {missing} never arrived within {self.spec.timeout:g}s (arrived: "
                f"{came})")
        return _Refusal(HandshakeTimeoutError(text, missing), "missing", missing)

    def _write(self, store: Any, r: int, code: str, reason: str, peers: list[Peer],
               missing: list[int]) -> None:
        frame = sign_verdict(self.spec.token, self.nonce,
                             VerdictFrame(VERSION, r, code, reason, peers, missing))
        store.set(_verdict(r), encode(frame))
        self.verdicted.add(r)

    def _finish(self, store: Any, code: str, reason: str, missing: list[int],
                peers: list[Peer] | None = None) -> None:
        """Write each node's verdict (one for every node that never came too, in case it
        comes now), wait for the acks owed, then delete every key of the rendezvous."""
        from torch.distributed import DistStoreError

        everyone = range(1, self.spec.nnodes)
        for r in everyone:
            if r not in self.verdicted:
                self._write(store, r, code, reason, peers or [], missing)
        unacked: list[int] = []
        deadline = time.monotonic() + _GRACE_S
        # A node whose join was read reads its verdict. After a refusal, a node still on
        # its way is waited for until the rendezvous deadline it would have met anyway
        # (a grace at least), to hear why rather than find the store gone: how late it
        # starts is the machine's doing, not a race to lose (a node that never came is
        # not waited for again: the deadline passed).
        owed = set(everyone) if code == "aborted" else self.read
        if code == "aborted":
            deadline = max(deadline, self.deadline)
        for r in sorted(owed):
            try:
                store.wait([_ack(r)], timedelta(seconds=max(0.001, deadline - time.monotonic())))
            except DistStoreError:
                if r in self.read:
                    unacked.append(r)
        for r in everyone:
            for key in (_join(r), _verdict(r), _ack(r)):
                store.delete_key(key)
        store.delete_key(_NONCE)
        if unacked and code == "admitted":
            raise RendezvousError(
                f"node 0 at {self.spec.master}: node(s) {unacked} joined but did not read "
                f"their verdict within {_GRACE_S:g}s (died or cut off after joining)")


# -- every other node --------------------------------------------------------------------


def _follow(spec: NodeSpec, addr: str) -> Membership:
    from torch.distributed import DistError, DistStoreError

    r, master = spec.node_rank, spec.master
    me = f"node {r} at {addr}"
    # node 0 names the missing at its deadline; a node waits a little longer to hear it
    deadline = time.monotonic() + spec.timeout + _GRACE_S

    def left() -> timedelta:
        return timedelta(seconds=max(0.001, deadline - time.monotonic()))

    store: Any = _connect(spec, me)  # Any: its stubs say str values; frames are bytes
    try:
        try:
            store.wait([_NONCE], left())
        except DistStoreError as exc:
            raise RendezvousError(f"{me}: the store at {master} answers but no rendezvous "
                                  f"began there (is it node 0 of this job?)") from exc
        nonce = bytes(store.get(_NONCE))
        frame = sign_join(spec.token, nonce,
                          JoinFrame(VERSION, r, spec.nnodes, addr, os.getpid(), spec.port))
        data = encode(frame)
        held = bytes(store.compare_set(_join(r), "", data))
        if held != data:
            other = decode_join(held, f"the frame holding node rank {r}")
            raise RendezvousError(f"{me}: node rank {r} is taken by the node at {other.addr} "
                                  f"(pid {other.pid}): check --node-rank on both hosts")
        try:
            store.wait([_verdict(r)], left())
        except DistStoreError as exc:
            raise HandshakeTimeoutError(
                f"{me}: no verdict from node 0 at {master} within "
                f"{spec.timeout + _GRACE_S:g}s", []) from exc
        verdict = decode_verdict(bytes(store.get(_verdict(r))), f"node 0's verdict for node {r}")
        store.delete_key(_verdict(r))
        store.set(_ack(r), b"1")
    except DistError as exc:
        raise RendezvousError(f"{me}: lost node 0's store at {master} (node 0 stopped the "
                              f"rendezvous or died: see its error): {_first_line(exc)}"
                              ) from exc
    finally:
        del store
    return _accept(spec, me, nonce, verdict)


def _connect(spec: NodeSpec, me: str) -> Any:
    """A client of node 0's store, within ``spec.timeout`` plus about one attempt.

    torch's client retries a connect until its timeout, but it overshoots by up to the
    timeout again (a 3 s timeout gave up after 3.6 s, an 8 s one after 13 s, against a
    host cut off by a partition). So it is given short attempts, retried to the deadline."""
    from torch.distributed import DistError, TCPStore  # type: ignore[attr-defined]

    deadline = time.monotonic() + spec.timeout
    while True:
        attempt = min(_CONNECT_ATTEMPT_S, max(0.05, deadline - time.monotonic()))
        try:
            store = TCPStore(spec.master_addr, spec.master_port, None, False,
                             timedelta(seconds=attempt), use_libuv=True)
        except DistError as exc:
            if time.monotonic() < deadline:
                continue  # node 0 not up yet, or the network not there yet
            raise RendezvousError(f"{me}: node 0's store at {spec.master} cannot be reached "
                                  f"within {spec.timeout:g}s: {_first_line(exc)}") from exc
        store.set_timeout(timedelta(seconds=spec.timeout))  # each reply's, from now on
        return store


def _accept(spec: NodeSpec, me: str, nonce: bytes, verdict: VerdictFrame) -> Membership:
    if verdict.code == "wrong_token":
        raise TokenMismatchError(f"{me} was refused by node 0 at {spec.master}: its job token "
                                 f"does not match the job's. Check PHALANX_JOB_TOKEN "
                                 f"({verdict.reason})")
    if verdict.code == "missing":
        raise HandshakeTimeoutError(f"{me}: {verdict.reason}", list(verdict.missing))
    if verdict.code != "admitted":
        raise RendezvousError(f"{me}: node 0 at {spec.master} stopped the rendezvous: "
                              f"{verdict.reason}")
    if not valid_verdict(spec.token, nonce, verdict) or verdict.node_rank != spec.node_rank:
        raise TokenMismatchError(f"{me}: the admission from {spec.master} does not carry this "
                                 f"job's token: node 0 there is another job, or this node's "
                                 f"PHALANX_JOB_TOKEN is wrong")
    return Membership(spec.nnodes, spec.node_rank, spec.master, tuple(verdict.peers), None)
