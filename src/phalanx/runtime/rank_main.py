"""Entry point of a rank process: ``python -m phalanx.runtime.rank_main``.

The parent starts it with the rank's end of a socketpair as fd ``PHALANX_CHANNEL_FD``.
The rank says HELLO, receives INIT (the parent's sys.path, the generation), says READY
and then serves TASK frames on a bounded thread pool until SHUTDOWN or until the parent
is gone.

Why several serving threads and not one: tasks of concurrent runs may block on each other
across ranks (a barrier in run A on rank 1 waiting for rank 2, which runs a task of run
B waiting for rank 1); executing one task at a time would deadlock them.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

import cloudpickle

from phalanx.lifecycle import CleanupError, failpoints
from phalanx.rendezvous import current

from . import _context
from ._errors import ParentTimeoutError, RemoteTaskError
from ._rank_points import START_BEFORE_HELLO as _START_BEFORE_HELLO
from ._rank_points import TASK_RECEIVED as _TASK_RECEIVED
from .channel import Kind, RankChannel, check_size
from .services import existing_rank_services

_PR_SET_PDEATHSIG = 1
_PR_SET_TIMERSLACK = 29
_TIMER_SLACK_NS = 1_000
_MAX_THREADS = 256  # serving threads per rank, whatever blocks
_PARENT_POLL_S = 0.2

log = logging.getLogger("phalanx.rank")


def _die_with_parent(parent_pid: int, use_pdeathsig: bool) -> None:
    """Exit when the parent dies: PDEATHSIG, plus a watch thread as the fallback.

    PDEATHSIG fires when the *thread* that started us exits, so the parent turns it
    off when a Worker is created outside the main thread; the watch (ppid changes when
    we are re-parented) and EOF on the control channel cover that case.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if use_pdeathsig:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # Short sleeps of waiters (barriers, handshakes) would otherwise round up to the
    # default 50 us timer slack: a waiter that just missed its peer paid 50 us more.
    libc.prctl(_PR_SET_TIMERSLACK, _TIMER_SLACK_NS, 0, 0, 0)
    if os.getppid() != parent_pid:  # died between fork and prctl
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(_PARENT_POLL_S)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="phalanx-parent-watch", daemon=True).start()


def _set_scheduler(policy: str) -> None:
    """SCHED_BATCH (the default) keeps a rank woken by a frame from preempting the
    parent in the middle of a fan-out: the parent's sends to every member of a step go
    out back to back and the members start together. Measured: a domain cycle ~15%
    shorter on two cores, task round trips unchanged (docs/design.md, Runtime)."""
    if policy == "batch":
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError as err:
            log.warning("could not set SCHED_BATCH (%s); ranks keep the default policy", err)


def _setup_logging(rank: int) -> None:
    level = os.environ.get("PHALANX_LOG_LEVEL", "WARNING").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def _dumps(value: Any) -> bytes:
    """The C pickler first (most results are plain data); cloudpickle for what it cannot
    do by reference (lambdas, classes of the rank's own ``__main__``)."""
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError):
        blob: bytes = cloudpickle.dumps(value)
        return blob


def _encode_error(exc: BaseException) -> bytes:
    tb = "".join(traceback.format_exception(exc))
    try:
        blob = cloudpickle.dumps(exc)
        pickle.loads(blob)  # an exception that pickles but cannot unpickle is useless
    except Exception:  # noqa: BLE001  any pickling failure: send a stand-in that always pickles
        blob = cloudpickle.dumps(RemoteTaskError(type(exc).__qualname__, str(exc)))
    return pickle.dumps((blob, tb))


class _Rank:
    """Serves TASK frames with a fixed set of threads in leader/follower style.

    Exactly one thread reads the channel at a time (it holds ``_read_lock``); when it
    has taken a frame it lets go of the lock, so another thread becomes the reader,
    and runs the task itself. A task thus costs no thread hand-off inside the rank,
    and up to ``threads`` tasks (of concurrent runs) can block on each other without
    deadlock.
    """

    def __init__(self, rank: int, channel: RankChannel, threads: int) -> None:
        self.rank = rank
        self.channel = channel
        self.threads = threads
        self._read_lock = threading.Lock()
        self._stopping = False
        self._shutdown_id = 0
        # Invariant: _idle counts serving threads not running a task. When the last idle
        # thread takes a task, another is started (up to _MAX_THREADS), so a frame is
        # always read even while every task blocks (in a handshake, say).
        self._state_lock = threading.Lock()
        self._idle = 0
        self._threads: list[threading.Thread] = []
        self._request_ids = itertools.count(1)
        self._replies: dict[int, tuple[threading.Event, list[bytes]]] = {}

    def request(self, obj: Any, timeout: float) -> Any:
        """Send an RDV request to the parent and wait for its reply."""
        rid = next(self._request_ids)
        event, slot = threading.Event(), list[bytes]()
        with self._state_lock:
            self._replies[rid] = (event, slot)
        try:
            self.channel.send(Kind.RDV, rid, pickle.dumps(obj))
            if not event.wait(timeout):
                raise ParentTimeoutError(f"rank {self.rank}: the parent did not answer "
                                         f"rendezvous request {rid} within {timeout:g}s")
            return pickle.loads(slot[0])
        finally:
            with self._state_lock:
                self._replies.pop(rid, None)

    def _start_thread(self) -> None:
        t = threading.Thread(target=self._serve_thread,
                             name=f"rank{self.rank}-serve-{len(self._threads)}")
        self._threads.append(t)
        self._idle += 1
        t.start()

    def run_task(self, msg_id: int, payload: bytes, user: bool) -> None:
        try:
            if user:
                _TASK_RECEIVED.hit()
            fn, args, kwargs = cloudpickle.loads(payload)
            result = fn(*args, **kwargs)
            out = _dumps(result)
            check_size(len(out), self.channel.max_message_bytes, f"the result of task {msg_id}")
            kind = Kind.RESULT_OK
        # BaseException on purpose: a task's SystemExit or KeyboardInterrupt must fail that
        # task visibly, not end a serving thread silently and leave its future pending.
        except BaseException as exc:  # noqa: BLE001
            out, kind = _encode_error(exc), Kind.RESULT_ERR
        try:
            self.channel.send(kind, msg_id, out)
        except OSError:
            os._exit(1)  # the parent is gone: nothing to report to

    def _serve_thread(self) -> None:
        while True:
            with self._read_lock:
                if self._stopping:
                    return
                frame = self.channel.recv()
                if frame is None:
                    # EOF without SHUTDOWN: the parent died. Leave at once; tasks running
                    # in other threads must not outlive the job.
                    os._exit(1)
                kind, msg_id, payload = frame
                if kind is Kind.SHUTDOWN:
                    self._stopping = True
                    self._shutdown_id = msg_id
                    return
            if kind is Kind.TASK or kind is Kind.CONTROL:
                with self._state_lock:
                    self._idle -= 1
                    if self._idle == 0 and len(self._threads) < _MAX_THREADS:
                        self._start_thread()
                self.run_task(msg_id, payload, user=kind is Kind.TASK)
                with self._state_lock:
                    self._idle += 1
            elif kind is Kind.RDV_REPLY:
                with self._state_lock:
                    waiter = self._replies.get(msg_id)
                if waiter is not None:
                    waiter[1].append(payload)
                    waiter[0].set()
            else:
                log.error("rank %d: unexpected frame kind %s from the parent", self.rank, kind)

    def serve(self) -> int:
        with self._state_lock:
            for _ in range(self.threads):
                self._start_thread()
        joined = 0
        while True:  # SHUTDOWN: every thread finishes its task, then we say BYE
            with self._state_lock:
                if joined == len(self._threads):
                    break
                t = self._threads[joined]
            t.join()
            joined += 1
        # The Worker's close journal asked for this before SHUTDOWN and reported the
        # outcome; what is still registered (that step failed, or the parent never
        # asked) is closed here so the process never exits holding a service.
        registry = existing_rank_services()
        if registry is not None:
            try:
                registry.close_all()
            except CleanupError as exc:
                log.error("rank %d: rank services failed to close at shutdown: %s",
                          self.rank, exc)
        self.channel.send(Kind.BYE, self._shutdown_id, b"")
        return 0


def main() -> int:
    rank = int(os.environ["PHALANX_RANK"])
    parent_pid = int(os.environ["PHALANX_PARENT_PID"])
    # The terminal's Ctrl-C reaches the whole process group, and so does the SIGTERM of
    # `timeout`, systemd (KillMode=control-group) or a container runtime: the parent
    # handles it and closes the worker in order (in-flight work finishes, then SHUTDOWN,
    # then SIGKILL at the close deadline), so a rank must not die of it on its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent(parent_pid, os.environ.get("PHALANX_PDEATHSIG", "1") == "1")
    _setup_logging(rank)
    _set_scheduler(os.environ.get("PHALANX_RANK_SCHED", "batch"))
    failpoints.set_process_rank(rank)
    _context.set_rank(rank)
    # The catalogue is a table in lifecycle: the env may arm any point of any layer now,
    # before the modules that carry it are imported.
    failpoints.arm_from_env()
    _START_BEFORE_HELLO.hit()
    sock = socket.socket(fileno=int(os.environ["PHALANX_CHANNEL_FD"]))
    channel = RankChannel(sock, int(os.environ["PHALANX_MAX_MESSAGE_BYTES"]))
    token = os.urandom(8).hex() if rank == 0 else None
    channel.send(Kind.HELLO, 0, pickle.dumps((rank, os.getpid(), token)))
    frame = channel.recv()
    if frame is None or frame[0] is not Kind.INIT:
        return 1
    init: dict[str, Any] = pickle.loads(frame[2])
    sys.path[:] = init["sys_path"]
    _context.set_world(init["world_size"], init["generation"], init["job_token"])
    server = _Rank(rank, channel, init["threads"])
    backend = current.make_backend(init["rendezvous"], rank, server.request)
    current.install(backend, rank)
    channel.send(Kind.READY, 0, pickle.dumps({"store_port": getattr(backend, "port", None)}))
    code = server.serve()
    backend.close()
    channel.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
