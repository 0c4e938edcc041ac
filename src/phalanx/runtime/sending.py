"""The parent's sends to ranks, each bounded by a deadline.

A rank that stops reading its control channel (stopped by a signal, or wedged) fills
the socket's buffer; a blocking ``sendall`` would then wait forever, holding the rank's
send lock, so every later sender to that rank would wait too. Here every send has a
deadline and gives up early once the rank is lost; the hub thread never waits at all
(what it cannot send at once is finished on a short-lived thread of its own).

The parent's end of each channel is non-blocking (rank_process.RankProcess).
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Callable

from ._errors import WorkerError

__all__ = ["SendTimeoutError", "Sender"]

log = logging.getLogger("phalanx.runtime")

_SLICE_S = 0.1  # how often a waiting send looks whether its rank was lost meanwhile
HUB_SEND_S = 30.0  # a reply the hub could not send at once: its deadline on a thread


class SendTimeoutError(WorkerError, TimeoutError):
    """A frame could not be sent by its deadline (or its rank was lost meanwhile).
    ``sent``: how many of its ``total`` bytes went out (> 0: the channel is torn)."""

    def __init__(self, message: str, rank: int, sent: int, total: int) -> None:
        super().__init__(message)
        self.rank = rank
        self.sent = sent
        self.total = total


class _Channel:
    __slots__ = ("fileno", "lock", "send")

    def __init__(self, send: Callable[[memoryview], int], fileno: int) -> None:
        self.send = send
        self.fileno = fileno
        self.lock = threading.Lock()


class Sender:
    """Per-rank send locks and bounded sends.

    ``is_lost(rank)``: a send gives up once it is true; ``on_timeout(err)``: called (in
    the sending thread, outside the lock) for a send that gave up, so the worker can
    apply the hung-rank rule and retire a torn channel.
    """

    def __init__(self, is_lost: Callable[[int], bool],
                 on_timeout: Callable[[SendTimeoutError], None]) -> None:
        self._channels: dict[int, _Channel] = {}
        self._is_lost = is_lost
        self._on_timeout = on_timeout

    def add(self, rank: int, send: Callable[[memoryview], int], fileno: int) -> None:
        self._channels[rank] = _Channel(send, fileno)

    def send(self, rank: int, frame: bytes, deadline: float) -> None:
        """Send ``frame`` whole by ``deadline``; SendTimeoutError (after ``on_timeout``)
        if not. OSError if the channel is closed."""
        ch = self._channels[rank]
        while not ch.lock.acquire(timeout=max(0.0, min(_SLICE_S, deadline - time.monotonic()))):
            if time.monotonic() >= deadline or self._is_lost(rank):
                err = SendTimeoutError(
                    f"could not send a {len(frame)}-byte frame to rank {rank}: another send "
                    f"to it did not finish by the deadline", rank, 0, len(frame))
                self._on_timeout(err)
                raise err
        self._finish(rank, ch, memoryview(frame), 0, deadline)

    def send_from_hub(self, rank: int, frame: bytes) -> None:
        """Send without waiting (the hub thread): what cannot go out at once is finished
        on a thread of its own, within HUB_SEND_S."""
        ch = self._channels[rank]
        view = memoryview(frame)
        sent = 0
        if ch.lock.acquire(blocking=False):
            try:
                sent = ch.send(view)
            except BlockingIOError:
                pass
            except BaseException:
                ch.lock.release()
                raise
            if sent == len(frame):
                ch.lock.release()
                return
        else:
            sent = -1  # the lock is someone else's: the thread takes it first

        def finish() -> None:
            try:
                deadline = time.monotonic() + HUB_SEND_S
                if sent < 0:
                    self.send(rank, frame, deadline)
                else:
                    self._finish(rank, ch, view, sent, deadline)
            except OSError as err:
                log.warning("phalanx: a reply to rank %d was not sent: %s", rank, err)

        threading.Thread(target=finish, name=f"phalanx-send-{rank}", daemon=True).start()

    def _finish(self, rank: int, ch: _Channel, view: memoryview, sent: int,
                deadline: float) -> None:
        """Send the rest of ``view`` from ``sent`` on; releases ``ch.lock`` (held)."""
        total = len(view)
        try:
            while sent < total:
                try:
                    sent += ch.send(view[sent:])
                    continue
                except BlockingIOError:
                    pass
                left = deadline - time.monotonic()
                if left <= 0 or self._is_lost(rank):
                    break
                poller = select.poll()
                poller.register(ch.fileno, select.POLLOUT)
                poller.poll(min(left, _SLICE_S) * 1e3)
        finally:
            ch.lock.release()
        if sent < total:
            why = ("the rank was lost meanwhile" if self._is_lost(rank)
                   else "the rank does not read its control channel")
            err = SendTimeoutError(
                f"could not send a {total}-byte frame to rank {rank} by its deadline "
                f"({sent} bytes went out): {why}", rank, sent, total)
            self._on_timeout(err)
            raise err
