"""The parent's IO thread: one selector over every rank's channel and stderr pipe.

One thread for all ranks (not one or two per rank) keeps the parent's thread count
constant in the rank count, and a reply costs one wake-up: select, recv, resolve.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import IO

from ._errors import HubStuckError, MessageTooLargeError
from .channel import HEADER, Kind, check_size

__all__ = ["Hub"]

log = logging.getLogger("phalanx.runtime")

FrameHandler = Callable[[int, Kind, int, bytes], None]
EofHandler = Callable[[int], None]
StderrHandler = Callable[[int, str], None]


class _Conn:
    __slots__ = ("buf", "rank", "sock")

    def __init__(self, rank: int, sock: socket.socket) -> None:
        self.rank = rank
        self.sock = sock
        self.buf = bytearray()


class _Exit:
    __slots__ = ("conn", "pidfd")

    def __init__(self, conn: _Conn, pidfd: int) -> None:
        self.conn = conn
        self.pidfd = pidfd


class Hub:
    def __init__(
        self,
        on_frame: FrameHandler,
        on_eof: EofHandler,
        on_stderr: StderrHandler,
        max_message_bytes: int,
        on_tick: Callable[[], None] | None = None,
        tick_s: float = 0.1,
    ) -> None:
        self._on_tick = on_tick
        self._tick_s = tick_s
        self._on_frame = on_frame
        self._on_eof = on_eof
        self._on_stderr = on_stderr
        self._max = max_message_bytes
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._pending: list[Callable[[], None]] = []  # selector changes, run on the hub thread
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="phalanx-hub", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _call_soon(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._pending.append(fn)
        os.write(self._wake_w, b"x")

    def add(self, rank: int, sock: socket.socket, stderr: IO[bytes] | None,
            pidfd: int | None = None) -> None:
        """Watch a rank's channel, its stderr and (``pidfd``) its exit: a dead rank is
        noticed by its pidfd even while a process it forked holds the channel open."""
        def register() -> None:
            conn = _Conn(rank, sock)
            self._sel.register(sock, selectors.EVENT_READ, conn)
            if stderr is not None:
                os.set_blocking(stderr.fileno(), False)
                self._sel.register(stderr, selectors.EVENT_READ, rank)
            if pidfd is not None:
                self._sel.register(pidfd, selectors.EVENT_READ, _Exit(conn, pidfd))

        self._call_soon(register)

    def remove(self, sock: socket.socket, stderr: IO[bytes] | None, timeout: float = 5.0,
               pidfd: int | None = None) -> None:
        """Unregister a rank's fds and wait until the hub thread no longer touches them."""
        done = threading.Event()

        def unregister() -> None:
            if pidfd is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self._sel.unregister(pidfd)
            for f in (sock, stderr):
                if f is not None and f.fileno() >= 0:
                    try:
                        self._sel.unregister(f)
                    except (KeyError, ValueError):
                        pass  # already dropped at EOF
            done.set()

        if not self._thread.is_alive():
            unregister()
            return
        self._call_soon(unregister)
        if not done.wait(timeout):
            raise HubStuckError(f"phalanx hub thread did not unregister a rank's channel "
                                f"(fd {sock.fileno()}) within {timeout}s")

    def stop(self, timeout: float = 5.0) -> None:
        self._stop = True
        if self._thread.is_alive():
            os.write(self._wake_w, b"x")
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise HubStuckError(f"phalanx hub thread did not stop within {timeout}s")
        self._sel.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _loop(self) -> None:
        next_tick = time.monotonic() + self._tick_s
        while not self._stop:
            events = self._sel.select(max(0.0, next_tick - time.monotonic()))
            if self._on_tick is not None and time.monotonic() >= next_tick:
                next_tick = time.monotonic() + self._tick_s
                try:
                    self._on_tick()
                except Exception:
                    log.exception("phalanx hub: periodic tick failed")
            registered = self._sel.get_map()
            for key, _ in events:
                data = key.data
                if registered.get(key.fd) is not key:
                    continue  # unregistered by a wake-up earlier in this batch (remove())
                if data is None:
                    self._drain_wakeups()
                elif isinstance(data, _Conn):
                    self._read_channel(data)
                elif isinstance(data, _Exit):
                    self._exited(data)
                else:
                    self._read_stderr(data, key.fileobj)  # type: ignore[arg-type]

    def _drain_wakeups(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 4096)
        with self._lock:
            pending, self._pending = self._pending, []
        for fn in pending:
            fn()

    def _exited(self, ex: _Exit) -> None:
        """The rank's process exited: read what it sent before it died, then handle the
        loss now, whether or not the channel's EOF comes (a process it forked may hold
        the channel open). The loss handler is idempotent: a later EOF is a no-op."""
        self._sel.unregister(ex.pidfd)
        conn = ex.conn
        if self._sel.get_map().get(conn.sock.fileno()) is None:
            return  # its EOF came first and was handled
        while self._read_channel(conn):
            pass
        if self._sel.get_map().get(conn.sock.fileno()) is not None:  # no EOF read
            self._on_eof(conn.rank)

    def _read_channel(self, conn: _Conn) -> bool:
        """Read what is there, never waiting; True if data came (more may follow)."""
        try:
            chunk = conn.sock.recv(1 << 16, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError, TimeoutError):
            return False
        except OSError:
            chunk = b""
        if not chunk:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(conn.sock)
            self._on_eof(conn.rank)
            return False
        buf = conn.buf
        buf += chunk
        while len(buf) >= HEADER.size:
            length, kind, msg_id = HEADER.unpack_from(buf)
            try:
                check_size(length, self._max, f"a frame from rank {conn.rank}")
            except MessageTooLargeError:
                # Ranks check sizes before sending: this is a broken stream, not a big
                # result. Treat it as the rank's channel closing.
                log.exception("phalanx hub: rank %d sent a corrupt frame header", conn.rank)
                self._sel.unregister(conn.sock)
                self._on_eof(conn.rank)
                return False
            end = HEADER.size + length
            if len(buf) < end:
                break
            payload = bytes(buf[HEADER.size:end])
            del buf[:end]
            try:
                self._on_frame(conn.rank, Kind(kind), msg_id, payload)
            except Exception:  # a handler bug must not kill the hub and hang every run
                log.exception("phalanx hub: handling a frame from rank %d failed", conn.rank)
        return True

    def _read_stderr(self, rank: int, f: IO[bytes]) -> None:
        try:
            chunk = os.read(f.fileno(), 1 << 16)
        except BlockingIOError:
            return
        if not chunk:
            self._sel.unregister(f)
            return
        text = chunk.decode(errors="replace")
        self._on_stderr(rank, text)
        try:
            sys.stderr.write(text)
        except (OSError, ValueError):
            pass  # the parent's stderr is closed; the tail is still kept
