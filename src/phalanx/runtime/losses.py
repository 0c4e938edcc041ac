"""Noticing a lost rank and failing what depends on it, at once.

A rank is lost when it died (its pidfd turned readable in the hub; its channel's EOF,
the only sign where pidfd_open is missing, which a process the rank forked delays; or
an exit found first when a task fails: a survivor's barrier sees a dead peer by its
pid before the parent reads the EOF) or hung (stopped by a signal once a task deadline
passed; while the worker closes, at once). What the loss fails is decided by
:class:`~.outstanding.Outstanding`; this module notices losses and applies them. The
Worker calls it from the hub thread (exits, EOF, failed results, ticks), from a waiter
whose task expired, from a send that timed out, and from close().
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ._errors import RankDiedError
from .outstanding import Outstanding
from .rank_process import RankProcess
from .state import WorkerState
from .tasks import TaskFuture

__all__ = ["Losses"]

_EXIT_WAIT_S = 2.0  # after a channel EOF, how long to wait for the rank's exit status

#: Called once per rank, at its first loss: (rank, the error, whether the worker closes).
FirstLoss = Callable[[int, RankDiedError, bool], None]


class Losses:
    def __init__(self, procs: dict[int, RankProcess], outstanding: Outstanding,
                 state: Callable[[], WorkerState], on_first_loss: FirstLoss,
                 on_task_failed: Callable[[TaskFuture], None]) -> None:
        self._procs = procs  # the worker's own dict: filled as ranks start
        self._outstanding = outstanding
        self._state = state
        self._on_first_loss = on_first_loss
        self._on_task_failed = on_task_failed

    def notice_exits(self) -> None:
        """Handle the exit of any rank on its way out whose EOF was not read yet."""
        for p in list(self._procs.values()):
            if not self._outstanding.exited(p.rank) and p.exiting():
                self.lost(p.rank)

    def check_hung(self, *, expired_only: bool = False) -> None:
        """The hung-rank rule: once a task deadline passes, a rank that is stopped (by a
        signal) with work outstanding is treated as dead (RankHungError); while the worker
        closes, at once (close's calls must not wait on it)."""
        state = self._state()
        if state in (WorkerState.STARTING, WorkerState.CLOSED):
            return  # starting: the start deadline decides
        running = state is WorkerState.RUNNING
        ranks = self._outstanding.busy_ranks(time.monotonic() if expired_only and running
                                             else None)
        for rank in sorted(ranks):
            signo = self._procs[rank].stop_signal()
            if signo is not None:
                self.lost(rank, stop_signal=signo)

    def lost(self, rank: int, *, stop_signal: int | None = None, flush: bool = True) -> None:
        """A rank died (``stop_signal`` None) or hung: fail what depends on it at once.

        Its own outstanding tasks fail (and, if it exited, are finished); unless the
        worker is closing, so does every outstanding task of every live run and of every
        ``call_ranks`` call that includes it, on every rank: those are abandoned, their
        ranks may still run them (the fence waits; close() stops those ranks). Idempotent.
        """
        proc = self._procs[rank]
        if stop_signal is None:
            proc.wait_exit(_EXIT_WAIT_S)
            if flush:
                proc.flush_stderr()
        closing = self._state() in (WorkerState.CLOSING, WorkerState.CLOSED)
        err = proc.lost_error(stop_signal, closing)
        loss = self._outstanding.lose(rank, err, exited=stop_signal is None, spread=not closing)
        if loss is None:
            return
        if loss.first:
            self._on_first_loss(rank, err, closing)
        for f in loss.finish:
            f.set_exception(err)
            self._on_task_failed(f)
        for f in loss.abandon:
            f.abandon(err)
        proc.startup.put((None, err))
