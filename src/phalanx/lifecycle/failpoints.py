"""Named failpoints in the production code path.

Every failpoint of phalanx is listed, by layer, in :mod:`phalanx.lifecycle.catalogue`,
so the whole catalogue is known once this module is imported. The module that carries
a point declares it once, at its import, and hits it at its acquisition or release
step::

    _WINDOW_MAPPED = Failpoint("domain.alloc.window_mapped")
    ...
    _WINDOW_MAPPED.hit()

A name missing from the catalogue is refused at declaration (a typo fails at import),
except under ``test.``: tests declare their own points there.

Tests and operators arm failpoints by name in any process of a job: in this process
with :func:`arm`, in rank processes through ``Worker.arm_failpoint`` or at start-up
through the ``PHALANX_FAILPOINTS`` environment variable
(``"name=raise;other=hang:5;third=kill"``), which rank processes inherit.

Cost when disarmed: one global lookup and a falsy test (see ``Failpoint.hit``).
"""

from __future__ import annotations

import enum
import errno
import os
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from ._errors import FailpointError, PhalanxError
from .catalogue import POINTS

__all__ = [
    "Action",
    "Failpoint",
    "FailpointSpecError",
    "arm",
    "armed",
    "catalogue",
    "check",
    "declared",
    "disarm",
    "disarm_all",
    "fired",
    "parse_spec",
    "set_process_rank",
    "wait_fired",
]

ENV_VAR = "PHALANX_FAILPOINTS"
#: Names under this prefix are a test's own points, declared without a catalogue row.
TEST_PREFIX = "test."


class FailpointSpecError(PhalanxError, ValueError):
    """A failpoint spec string or name could not be understood."""


class Action(enum.Enum):
    RAISE = "raise"  # raise FailpointError at the point
    HANG = "hang"  # block for `arg` seconds (default 3600), then raise FailpointError
    DELAY = "delay"  # block for `arg` seconds (default 1), then let the step go on
    KILL = "kill"  # SIGKILL this process: the point's step never completes
    EXIT = "exit"  # os._exit(arg or 1) without cleanup
    ERRNO = "errno"  # raise OSError(arg) as the step's system call would (root ignores modes)
    # block until the point is disarmed (at most `arg` seconds, default 60, then raise
    # FailpointError): a test holds one thread at a step, does what a racing thread
    # would do meanwhile, and lets it go -- an interleaving without a timer
    PAUSE = "pause"


@dataclass(frozen=True)
class Arming:
    action: Action
    arg: float | None = None
    skip: int = 0  # let this many hits pass before firing
    times: int | None = None  # fire at most this many times (None: every hit after skip)

    def spec(self) -> str:
        s = self.action.value
        if self.arg is not None:
            s += f":{self.arg:g}"
        if self.skip:
            s += f"@{self.skip}"
        if self.times is not None:
            s += f"*{self.times}"
        return s


# Every point of phalanx (name -> description), known before any carrying module loads.
_CATALOGUE: dict[str, str] = {n: d for points in POINTS.values() for n, d in points.items()}
# Points declared by a Failpoint object in this process (catalogued and test points).
_DECLARED: dict[str, str] = {}
# Armed failpoints of this process. Empty dict => every hit() is a single falsy test.
_ARMED: dict[str, Arming] = {}
_HITS: dict[str, int] = {}
_FIRED: dict[str, int] = {}
_LOCK = threading.Lock()
# a paused hit waits here for its point's disarm; wait_fired for a point's hits
_DISARMED = threading.Condition(_LOCK)
_PROCESS_RANK: int | None = None


class Failpoint:
    """One named point; ``hit()`` does nothing unless the point is armed."""

    __slots__ = ("description", "name")

    def __init__(self, name: str, description: str | None = None) -> None:
        # The catalogue's row is the one description; a site's own text (if any) is
        # documentation for the reader there, for test points the only one.
        catalogued = _CATALOGUE.get(name)
        if catalogued is None and not name.startswith(TEST_PREFIX):
            raise FailpointSpecError(
                f"failpoint {name!r} is not in the catalogue: add a row for it to "
                f"phalanx/lifecycle/catalogue.py (and a scenario to "
                f"tests/test_failpoint_sweep.py), or fix the name's spelling")
        if name in _DECLARED:
            raise FailpointSpecError(f"failpoint {name!r} declared twice")
        self.name = name
        self.description = catalogued or description or ""
        _DECLARED[name] = self.description

    def hit(self) -> None:
        if _ARMED:
            _maybe_fire(self.name)

    def __repr__(self) -> str:
        return f"Failpoint({self.name!r})"


def _maybe_fire(name: str) -> None:
    with _LOCK:
        arming = _ARMED.get(name)
        if arming is None:
            return
        hits = _HITS.get(name, 0)
        _HITS[name] = hits + 1
        if hits < arming.skip:
            return
        fired = _FIRED.get(name, 0)
        if arming.times is not None and fired >= arming.times:
            return
        _FIRED[name] = fired + 1
        _DISARMED.notify_all()  # wait_fired
    if arming.action is Action.RAISE:
        raise FailpointError(name, _PROCESS_RANK)
    if arming.action is Action.HANG:
        time.sleep(3600.0 if arming.arg is None else arming.arg)
        raise FailpointError(name, _PROCESS_RANK)
    if arming.action is Action.PAUSE:
        with _DISARMED:
            released = _DISARMED.wait_for(lambda: _ARMED.get(name) is not arming,
                                          60.0 if arming.arg is None else arming.arg)
        if not released:
            raise FailpointError(name, _PROCESS_RANK)
    if arming.action is Action.DELAY:  # a slow step: a window for a race to open
        time.sleep(1.0 if arming.arg is None else arming.arg)
    if arming.action is Action.KILL:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # SIGKILL is asynchronous; never return into the step
    if arming.action is Action.ERRNO:
        code = int(arming.arg or errno.EIO)
        raise OSError(code, f"{os.strerror(code)} (failpoint {name})")
    if arming.action is Action.EXIT:
        os._exit(1 if arming.arg is None else int(arming.arg))


def set_process_rank(rank: int | None) -> None:
    """Name the rank of this process in FailpointErrors (rank processes call this)."""
    global _PROCESS_RANK
    _PROCESS_RANK = rank


def catalogue() -> dict[str, str]:
    """Every failpoint of phalanx (name -> description), whatever has been imported.

    Test points (``test.*``) are not part of it; :func:`declared` lists them too.
    """
    return dict(sorted(_CATALOGUE.items()))


def declared() -> dict[str, str]:
    """The points a module of this process has declared so far (test points included)."""
    with _LOCK:
        return dict(sorted(_DECLARED.items()))


def _known(name: str) -> bool:
    return name in _CATALOGUE or name in _DECLARED


def check(points: Mapping[str, str]) -> None:
    """Refuse unknown names and bad specs in ``name -> spec`` before they reach a rank."""
    for name, spec in points.items():
        if not _known(name):
            raise FailpointSpecError(
                f"unknown failpoint {name!r}; phalanx.lifecycle.failpoints.catalogue() "
                f"lists them")
        parse_spec(spec or "raise")


def parse_spec(spec: str) -> Arming:
    """Parse ``ACTION[:ARG][@SKIP][*TIMES]``, e.g. ``raise``, ``hang:2``, ``raise@3*1``."""
    rest = spec.strip()
    times: int | None = None
    skip = 0
    try:
        if "*" in rest:
            rest, t = rest.split("*", 1)
            times = int(t)
        if "@" in rest:
            rest, s = rest.split("@", 1)
            skip = int(s)
        arg: float | None = None
        if ":" in rest:
            rest, a = rest.split(":", 1)
            arg = float(a)
        return Arming(Action(rest), arg, skip, times)
    except ValueError as exc:
        raise FailpointSpecError(
            f"bad failpoint spec {spec!r}: expected ACTION[:ARG][@SKIP][*TIMES] with ACTION "
            f"one of {[a.value for a in Action]}"
        ) from exc


def arm(name: str, spec: str | Arming = "raise") -> None:
    """Arm ``name`` in this process. Unknown names are refused (typos would test nothing)."""
    if not _known(name):
        raise FailpointSpecError(
            f"unknown failpoint {name!r}; phalanx.lifecycle.failpoints.catalogue() lists them"
        )
    arming = parse_spec(spec) if isinstance(spec, str) else spec
    with _LOCK:
        _ARMED[name] = arming
        _HITS.pop(name, None)
        _FIRED.pop(name, None)


def disarm(name: str) -> None:
    with _LOCK:
        _ARMED.pop(name, None)
        _DISARMED.notify_all()


def disarm_all() -> None:
    with _LOCK:
        _ARMED.clear()
        _HITS.clear()
        _FIRED.clear()
        _DISARMED.notify_all()


def wait_fired(name: str, count: int = 1, timeout: float = 60.0) -> bool:
    """Wait until ``name`` fired ``count`` times in this process since it was armed
    (a paused point: a thread is held there now); False at the deadline."""
    deadline = time.monotonic() + timeout
    with _DISARMED:
        while _FIRED.get(name, 0) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            _DISARMED.wait(left)
    return True


def armed() -> dict[str, str]:
    """Armed failpoints of this process as ``name -> spec``."""
    with _LOCK:
        return {n: a.spec() for n, a in _ARMED.items()}


def fired(name: str) -> int:
    """How many times ``name`` fired in this process since it was armed."""
    with _LOCK:
        return _FIRED.get(name, 0)


def encode_env(points: dict[str, str]) -> str:
    return ";".join(f"{n}={s}" for n, s in points.items())


def arm_from_env(value: str | None = None) -> None:
    """Arm what ``PHALANX_FAILPOINTS`` names. Called once a process has imported phalanx."""
    text = os.environ.get(ENV_VAR, "") if value is None else value
    for item in filter(None, (p.strip() for p in text.split(";"))):
        name, _, spec = item.partition("=")
        arm(name.strip(), spec or "raise")
