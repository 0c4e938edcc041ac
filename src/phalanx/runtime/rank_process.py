"""Parent-side handle of one rank process: start it, describe its exit, stop it."""

from __future__ import annotations

import collections
import logging
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phalanx.lifecycle.failpoints import ENV_VAR as FAILPOINTS_ENV
from phalanx.lifecycle.failpoints import encode_env

from ._errors import RankDiedError, RankHungError, RankStartError
from .channel import DEFAULT_MAX_MESSAGE_BYTES, Kind

__all__ = ["RankProcess", "describe_exit", "shutdown"]

log = logging.getLogger("phalanx.runtime")

_STDERR_TAIL_LINES = 40
_STOP_POLL_S = 0.1  # while waiting for a rank to stop, how often to look for a signal stop


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def _open_pidfd(pid: int) -> int | None:
    """A pidfd for our child ``pid`` (Linux >= 5.3), or None: then a death is noticed by
    the control channel's EOF alone."""
    open_pidfd = getattr(os, "pidfd_open", None)
    if open_pidfd is None:
        return None
    try:
        return int(open_pidfd(pid))
    except OSError as err:  # ENOSYS on an old kernel; ESRCH cannot happen (not reaped)
        log.debug("pidfd_open(%d) failed (%s): watching the channel's EOF only", pid, err)
        return None


class RankProcess:
    """One rank's process, its end of the control channel, and its stderr tail.

    The rank runs ``python -m phalanx.runtime.rank_main`` in a fresh interpreter
    (exec, never a bare fork: safe with threads and torch in the parent), with the
    parent's stdout and a stderr pipe the hub forwards and remembers.
    """

    def __init__(
        self,
        rank: int,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        failpoints: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        scheduler: str = "batch",
    ) -> None:
        self.rank = rank
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc_env = dict(os.environ)
            if env:
                proc_env.update(env)
            package_root = str(Path(__file__).resolve().parents[2])  # src/
            proc_env["PYTHONPATH"] = os.pathsep.join(
                p for p in (package_root, proc_env.get("PYTHONPATH", "")) if p
            )
            proc_env.update(
                PHALANX_RANK=str(rank),
                PHALANX_PARENT_PID=str(os.getpid()),
                PHALANX_CHANNEL_FD=str(child_sock.fileno()),
                PHALANX_MAX_MESSAGE_BYTES=str(max_message_bytes),
                PHALANX_RANK_SCHED=scheduler,
                # PDEATHSIG follows the starting *thread*; see rank_main._die_with_parent.
                PHALANX_PDEATHSIG="1" if threading.current_thread() is threading.main_thread()
                else "0",
            )
            if failpoints:
                proc_env[FAILPOINTS_ENV] = encode_env(failpoints)
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "phalanx.runtime.rank_main"],
                pass_fds=(child_sock.fileno(),),
                stdin=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=proc_env,
            )
        except BaseException:
            parent_sock.close()
            raise
        finally:
            child_sock.close()
        parent_sock.setblocking(False)  # sends are bounded (sending.py), reads the hub's
        self.sock = parent_sock
        self.pid = self.proc.pid
        # Readable once the process exited: its death is noticed even while a process it
        # forked keeps the control channel open (no EOF then). None where unsupported.
        self.pidfd = _open_pidfd(self.pid)
        self._tail: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL_LINES)
        self._tail_lock = threading.Lock()
        # start-up frames (HELLO, READY) or (None, the error) if it died, from the hub
        self.startup: queue.Queue[tuple[Kind | None, Any]] = queue.Queue()

    def await_startup(self, want: Kind, deadline: float) -> Any:
        """The payload of start-up frame ``want``; RankStartError naming why not."""
        try:
            kind, payload = self.startup.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise RankStartError(
                f"rank {self.rank} (pid {self.pid}) did not send {want.name} before the start "
                f"deadline; it {'is still running' if self.proc.poll() is None else 'exited'}. "
                f"stderr tail:\n{self.stderr_tail() or '(empty)'}"
            ) from None
        if kind is None:
            raise RankStartError(
                f"{self.describe()} before it was ready. stderr tail:\n"
                f"{self.stderr_tail() or '(empty)'}"
            ) from payload
        if kind is not want:
            raise RankStartError(f"rank {self.rank} sent {kind.name} instead of {want.name}")
        return pickle.loads(payload) if payload else None

    def remember_stderr(self, text: str) -> None:
        with self._tail_lock:
            self._tail.extend(text.splitlines())

    def stderr_tail(self) -> str:
        with self._tail_lock:
            return "\n".join(self._tail)

    def describe(self) -> str:
        return f"rank {self.rank} (pid {self.pid}) {describe_exit(self.proc.poll())}"

    def exiting(self) -> bool:
        """Exited, or on its way out: what a peer's pid check (comm.rank_state.pid_alive)
        already reads as dead. A SIGKILLed rank's main thread is a zombie ('Z') while its
        other threads still exit, and only then can it be reaped (Popen.poll says None)."""
        if self.proc.poll() is not None:
            return True
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True  # our child's entry exists until we reap it
        return state in (b"Z", b"X")

    def stop_signal(self) -> int | None:
        """The signal that stopped this process (SIGSTOP, SIGTSTP, ...), or None if it
        runs or is gone. Asks the kernel with WNOWAIT: the state is left for others."""
        if self.proc.returncode is not None:
            return None
        try:
            info = os.waitid(os.P_PID, self.pid, os.WSTOPPED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return None  # reaped by now
        if info is None or info.si_code != os.CLD_STOPPED:
            return None
        return info.si_status

    def describe_stopped(self, signo: int) -> str:
        try:
            name = signal.Signals(signo).name
        except ValueError:
            name = f"signal {signo}"
        return f"rank {self.rank} (pid {self.pid}) is stopped by {name}"

    def lost_error(self, stop_signal: int | None, closing: bool) -> RankDiedError:
        """The error that fails what depended on this rank: hung (``stop_signal``), stopped
        by close, or died; it names rank, pid and the signal or exit code."""
        tail = f"stderr tail:\n{self.stderr_tail() or '(empty)'}"
        if stop_signal is not None:
            return RankHungError(
                f"{self.describe_stopped(stop_signal)} with tasks outstanding past a task "
                f"deadline: it is treated as dead; every task of every live run fails and "
                f"close() kills it. {tail}", self.rank, None, self.pid, stop_signal)
        if closing:
            return RankDiedError(f"{self.describe()}: stopped by Worker.close(). {tail}",
                                 self.rank, self.proc.poll(), self.pid)
        return RankDiedError(
            f"{self.describe()}: the rank died while tasks were outstanding; every task of "
            f"every live run fails with this error. {tail}", self.rank, self.proc.poll(),
            self.pid)

    def flush_stderr(self) -> None:
        """Keep what the rank wrote last (read without blocking; the hub forwards the rest)."""
        stderr = self.proc.stderr
        if stderr is None:
            return
        try:
            while chunk := stderr.read1(1 << 16) if hasattr(stderr, "read1") else b"":
                self.remember_stderr(chunk.decode(errors="replace"))
        except (BlockingIOError, OSError, ValueError):
            pass  # nothing more right now; the hub forwards the rest

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def close_fds(self) -> None:
        self.sock.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        if self.proc.stderr is not None:
            self.proc.stderr.close()


def shutdown(procs: list[RankProcess], ready: set[int], send_shutdown: Callable[[int], None],
             time_left: Callable[[], float]) -> None:
    """Ask every live rank to stop (SHUTDOWN) and wait until ``time_left()`` runs out;
    SIGKILL what did not stop by then. A rank that never said READY, or that is stopped
    by a signal, cannot stop gracefully: it is killed at once. The caller reaps."""
    live = [p for p in procs if p.proc.poll() is None]
    for p in live:
        if p.rank not in ready or p.stop_signal() is not None:
            p.kill()
            continue
        try:
            send_shutdown(p.rank)
        except OSError:
            pass  # already gone; reaped by the caller
    for p in live:
        # Waited in slices: a rank stopped by a signal while we wait (a group stop
        # completes only once every thread has stopped) is killed then, not at the deadline.
        while p.wait_exit(min(time_left(), _STOP_POLL_S)) is None:
            if p.stop_signal() is not None:
                log.warning("%s was stopped by a signal while closing: killing it",
                            p.describe())
                p.kill()
                break
            if time_left() <= 0:
                log.warning("%s did not stop by the close deadline: killing it",
                            p.describe())
                p.kill()
                break
