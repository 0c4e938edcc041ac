"""Who owns a generation, and whether that owner is provably dead.

An owner is (host, boot id, pid, pid start time): a pid alone is reused, a pid with
its start time is not; a boot id tells a generation left by a previous boot. Owners
on other hosts (a shared file system) cannot be probed; their lease decides.
"""

from __future__ import annotations

import enum
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

__all__ = ["Liveness", "OwnerRecord", "boot_id"]

_BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    try:
        return _BOOT_ID_PATH.read_text().strip()
    except OSError:  # not Linux: fall back to the boot time, which serves the same purpose
        return f"boot-time-{psutil.boot_time():.0f}"


def _start_time(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


class Liveness(enum.Enum):
    ALIVE = "alive"  # same host and boot, pid running with the recorded start time
    PID_GONE = "dead: pid gone"
    PID_REUSED = "dead: pid reused"  # the pid runs, but started at another time
    REBOOTED = "dead: previous boot"
    LEASE_VALID = "remote: lease valid"  # another host; its heartbeat is recent
    LEASE_EXPIRED = "dead: lease expired"  # another host; no heartbeat for too long
    UNREADABLE = "unknown: owner record unreadable"

    @property
    def dead(self) -> bool:
        return self.value.startswith("dead")


@dataclass(frozen=True)
class OwnerRecord:
    host: str
    boot_id: str
    pid: int
    start_time: float
    uid: int
    created: float
    version: int = 1

    @classmethod
    def of_this_process(cls) -> OwnerRecord:
        pid = os.getpid()
        return cls(socket.gethostname(), boot_id(), pid, _start_time(pid) or 0.0, os.getuid(),
                   time.time())

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> OwnerRecord:
        return cls(**json.loads(data))

    def liveness(self, lease_mtime: float, lease_expiry_s: float) -> Liveness:
        if self.host != socket.gethostname():
            expired = time.time() - lease_mtime > lease_expiry_s
            return Liveness.LEASE_EXPIRED if expired else Liveness.LEASE_VALID
        if self.boot_id != boot_id():
            return Liveness.REBOOTED
        started = _start_time(self.pid)
        if started is None:
            return Liveness.PID_GONE
        # create_time is derived from jiffies: allow rounding, not another process.
        if abs(started - self.start_time) > 1.0:
            return Liveness.PID_REUSED
        return Liveness.ALIVE
