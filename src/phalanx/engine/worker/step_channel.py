"""The engine's data plane on one host: a step goes to every rank through one
shared-memory segment, and rank 0's answer comes back through it (issue 43).

Before, every step rode the runtime's orchestration path: the encoded plan wrapped in a
pickled task per rank, submitted from a relay thread inside one long-lived run, sent
over each rank's control socket, and every rank replied; each step left two task
futures in that run for the run's (the engine's) whole life. Now the Worker only
starts, supervises and fails the ranks, and runs one long task per rank, the step loop
(``worker/rank.py``'s ``serve_steps``); a step is:

1. the parent writes the message (the encoded plan and its disk loads) into the plan
   area once, bumps ``plan_seq`` and wakes the ranks (one futex wake);
2. every rank copies the message out, runs it, and stores ``done[rank] = seq`` (rank 0
   first writes the encoded result into the result area; a rank that failed writes
   its error instead), then wakes the parent;
3. the parent waits until every rank's ``done`` holds the step, or one rank failed (it
   does not wait out the others' collectives then), and reads rank 0's result.

No pickle, no task, no future, no thread handoff and nothing allocated that outlives
the step. Every wait is sliced: the parent checks between slices that every rank is
alive (a dead rank fails the step at once, naming it) and that the step deadline has
not passed; a rank checks that the channel is still open.

Layout (little-endian 32-bit words; ``tp`` at most ``MAX_RANKS``)::

    0      plan_seq   the last message's number (ranks wait on it)
    4      plan_kind  HELLO, STEP or STOP
    8      plan_len
    12     answers    bumped by each rank after it answered (the parent waits on it)
    64+64r done_seq[r], status[r] (OK / FAILED), out_len[r]   (the parent waits on done)
    4096   error text, ERROR_BYTES per rank
    ...    the plan area (PLAN_BYTES), then rank 0's result area (RESULT_BYTES)

The segment's name is unlinked as soon as every rank has mapped it (the HELLO round):
nothing is left under /dev/shm whatever dies later (vLLM's lesson, docs/architecture.md).
"""

from __future__ import annotations

import enum
import mmap
import time
from collections.abc import Callable

import msgspec

from phalanx.comm import futex, shm

from .._errors import EngineDeadError, EngineError
from ..disk.rank0 import DiskLoads

__all__ = ["Kind", "RankEnd", "StepChannel", "StepMessage", "channel_name", "decode_message",
           "encode_message"]

MAX_RANKS = 63
ERROR_BYTES = 4096
PLAN_BYTES = 4 << 20
RESULT_BYTES = 1 << 20
_HEADER = 4096
_ERRORS = _HEADER

# A waiter wakes at least this often to check its peers (a dead rank, a closed channel).
_SLICE_S = 0.1


class Kind(enum.IntEnum):
    HELLO = 1  # every rank mapped the segment: its name can go
    STEP = 2   # a step message follows
    STOP = 3   # the loop ends


class Status(enum.IntEnum):
    OK = 0
    FAILED = 1


class StepMessage(msgspec.Struct, frozen=True):
    """What every rank gets for one step: the encoded plan, and its disk loads."""

    plan: bytes
    disk: DiskLoads | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StepMessage)


def encode_message(message: StepMessage) -> bytes:
    return _encoder.encode(message)


def decode_message(raw: bytes | memoryview) -> StepMessage:
    return _decoder.decode(raw)


def channel_name(generation: str, runner_id: str) -> str:
    """Under the Worker's generation prefix (``phx-<token>-``): a segment left by a
    killed parent is reclaimed with the rest of its generation (``phalanx doctor``)."""
    return f"phx-{generation}-steps-{runner_id}"


class _Segment:
    """The mapped segment and its words, for either end."""

    def __init__(self, mapping: mmap.mmap, tp: int) -> None:
        if not 1 <= tp <= MAX_RANKS:
            raise EngineError(f"a step channel serves 1 to {MAX_RANKS} ranks, not {tp}")
        self.map = mapping
        self.tp = tp
        self.plan_seq = futex.Word(mapping, 0)
        self.plan_kind = futex.Word(mapping, 4)
        self.plan_len = futex.Word(mapping, 8)
        self.answers = futex.Word(mapping, 12)
        self.done = [futex.Word(mapping, 64 + 64 * r) for r in range(tp)]
        self.status = [futex.Word(mapping, 68 + 64 * r) for r in range(tp)]
        self.out_len = [futex.Word(mapping, 72 + 64 * r) for r in range(tp)]
        self.plan_at = _ERRORS + ERROR_BYTES * tp
        self.result_at = self.plan_at + PLAN_BYTES

    @staticmethod
    def size(tp: int) -> int:
        return _ERRORS + ERROR_BYTES * tp + PLAN_BYTES + RESULT_BYTES

    def close(self) -> None:
        for w in (self.plan_seq, self.plan_kind, self.plan_len, self.answers, *self.done,
                  *self.status,
                  *self.out_len):
            w.release()
        self.map.close()


class StepChannel:
    """The parent's end: create, send a message, wait for every rank, close.

    Used by one thread at a time (the engine's): a step is sent only after the previous
    one was answered by every rank, so the plan area is never rewritten under a reader.
    """

    def __init__(self, name: str, tp: int) -> None:
        self.name = name
        fd = shm.create_segment(name, _Segment.size(tp))
        try:
            self._seg = _Segment(shm.map_fd(fd, _Segment.size(tp)), tp)
        except BaseException:
            shm.unlink_segment(name)
            raise
        self._linked = True
        self._seq = 0
        self.steps = 0  # messages answered (a statistic: nothing grows with it)

    def unlink(self) -> None:
        """Remove the name (every rank has mapped the segment, or none ever will)."""
        if self._linked:
            self._linked = False
            shm.unlink_segment(self.name)

    def hello(self, timeout: float, check: Callable[[], None]) -> None:
        """Wait until every rank's loop mapped the segment, then unlink its name."""
        self._send(Kind.HELLO, b"")
        self._wait(timeout, check)
        self.unlink()

    def step(self, message: StepMessage, timeout: float, check: Callable[[], None]) -> bytes:
        """Run one step on every rank; rank 0's encoded result. ``check`` raises when a
        rank is lost; it runs between the wait's slices."""
        self._send(Kind.STEP, _encoder.encode(message))
        out = self._wait(timeout, check)
        self.steps += 1
        return out

    def stop(self) -> None:
        """Ask every loop to end (no answer is awaited: a rank may be gone)."""
        self._send(Kind.STOP, b"")

    def _send(self, kind: Kind, payload: bytes) -> None:
        s = self._seg
        if len(payload) > PLAN_BYTES:
            raise EngineError(f"a step message of {len(payload)} bytes exceeds the step "
                              f"channel's {PLAN_BYTES} bytes")
        s.map[s.plan_at:s.plan_at + len(payload)] = payload
        s.plan_len.store(len(payload))
        s.plan_kind.store(kind)
        self._seq += 1
        s.plan_seq.store(self._seq)
        futex.wake(s.plan_seq)

    def _wait(self, timeout: float, check: Callable[[], None]) -> bytes:
        s, seq = self._seg, self._seq & 0xFFFFFFFF
        deadline = time.monotonic() + timeout
        while True:
            # read the counter first: an answer after this read changes it, so the
            # wait below returns at once (no lost wake-up)
            v = s.answers.value
            done = [s.done[r].value == seq for r in range(s.tp)]
            failed = [r for r in range(s.tp) if done[r] and s.status[r].value == Status.FAILED]
            if failed:  # each text names its rank ("rank 1: step failed: ...")
                raise EngineError("; ".join(_text(s, r) for r in failed))
            if all(done):
                n = s.out_len[0].value
                return bytes(s.map[s.result_at:s.result_at + n])
            now = time.monotonic()
            if now > deadline:
                late = ", ".join(f"rank {r}" for r in range(s.tp) if not done[r])
                raise EngineDeadError(f"{late} did not finish step message {seq} within "
                                      f"{timeout:g} s")
            futex.wait(s.answers, v, min(_SLICE_S, deadline - now))
            if s.answers.value == v:  # a slice passed without an answer
                check()

    def close(self) -> None:
        """Unmap (and unlink, if the HELLO round never finished)."""
        try:
            self.unlink()
        finally:
            self._seg.close()


def _text(s: _Segment, rank: int) -> str:
    at = _ERRORS + ERROR_BYTES * rank
    return bytes(s.map[at:at + s.out_len[rank].value]).decode(errors="replace")


class RankEnd:
    """A rank's end: wait for the next message, answer it."""

    def __init__(self, name: str, rank: int, tp: int) -> None:
        size = _Segment.size(tp)
        self._seg = _Segment(shm.map_fd(shm.open_segment(name), size), tp)
        self.rank = rank
        self._seen = 0  # a new segment's; the parent's first message (HELLO) is 1

    def next(self, alive: Callable[[], bool], idle: Callable[[], None] | None = None
             ) -> tuple[Kind, int, StepMessage | None]:
        """The next message: (kind, its number, the step message for STEP). Waits while
        ``alive()`` holds; past it, a STOP. ``idle()`` runs after each wait slice that
        passed with no message."""
        s = self._seg
        while (v := s.plan_seq.value) == self._seen:
            if not alive():
                return Kind.STOP, v, None
            futex.wait(s.plan_seq, v, _SLICE_S)
            if idle is not None and s.plan_seq.value == v:
                idle()
        self._seen = v
        kind = Kind(s.plan_kind.value)
        if kind is not Kind.STEP:
            return kind, v, None
        n = s.plan_len.value
        return kind, v, _decoder.decode(s.map[s.plan_at:s.plan_at + n])

    def answer(self, seq: int, result: bytes | None = None, error: str | None = None) -> None:
        """Report message ``seq`` done: rank 0's encoded result, or this rank's error."""
        s, r = self._seg, self.rank
        if error is not None:
            raw = error.encode()[:ERROR_BYTES]
            at = _ERRORS + ERROR_BYTES * r
            s.map[at:at + len(raw)] = raw
            s.out_len[r].store(len(raw))
            s.status[r].store(Status.FAILED)
        else:
            if result is not None:
                if len(result) > RESULT_BYTES:
                    self.answer(seq, error=f"a step result of {len(result)} bytes exceeds "
                                           f"the channel's {RESULT_BYTES}")
                    return
                s.map[s.result_at:s.result_at + len(result)] = result
                s.out_len[r].store(len(result))
            s.status[r].store(Status.OK)
        s.done[r].store(seq)
        # not atomic across ranks: two may store the same count, but the word changes
        # either way, which is all the parent's wait needs
        s.answers.store(s.answers.value + 1)
        futex.wake(s.answers)

    def close(self) -> None:
        self._seg.close()
