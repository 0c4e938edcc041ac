"""Snapshots of what a test run holds: child processes, fds, threads, /dev/shm, runtime dir.

Used by the session fixture in conftest.py (the suite fails on anything left behind)
and by tests that assert a loop of work stays flat.

/dev/shm is the machine's, not the session's: the suite runs in two pytest-xdist
workers (and other sessions may run beside it), so a segment that a process outside
this process's tree holds (mapped or open) is that process's, not ours, and is left out.
A segment nobody holds is counted wherever it shows: a leak fails the run even if
the other worker made it.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil


def default_runtime_dir() -> Path:
    env = os.environ.get("PHALANX_RUNTIME_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "phalanx" if xdg else Path(f"/tmp/phalanx-{os.getuid()}")


def _files_under(root: Path) -> frozenset[str]:
    if not root.is_dir():
        return frozenset()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + dirnames:
            out.append(os.path.relpath(os.path.join(dirpath, name), root))
    return frozenset(out)


def _held_by_others() -> set[str]:
    """/dev/shm names mapped or open in a process outside this one's tree."""
    ours = {os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))}
    held: set[str] = set()
    for pid in psutil.pids():
        if pid in ours:
            continue
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    i = line.find("/dev/shm/")
                    if i >= 0:
                        held.add(line[i + 9:].rstrip("\n").removesuffix(" (deleted)"))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    held.add(target[9:])
        except OSError:
            continue  # gone, or not ours to read
    return held


def shm_names() -> frozenset[str]:
    """This process tree's view of /dev/shm: every name but those others hold."""
    return frozenset(set(os.listdir("/dev/shm")) - _held_by_others())


def _fds() -> frozenset[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            continue  # the fd listdir itself used, closed by now
    return frozenset(out)


@dataclass(frozen=True)
class Snapshot:
    children: frozenset[str]
    fds: frozenset[str]
    threads: frozenset[str]
    shm: frozenset[str]
    runtime_files: frozenset[str]
    extra_dirs: dict[str, frozenset[str]] = field(default_factory=dict)

    @classmethod
    def take(cls, *dirs: Path) -> Snapshot:
        kids = []
        for p in psutil.Process().children(recursive=True):
            try:
                kids.append(f"{p.pid}:{' '.join(p.cmdline())[:120]}")
            except psutil.Error:
                continue
        return cls(
            children=frozenset(kids),
            fds=_fds(),
            threads=frozenset(f"{t.name}#{t.ident}" for t in threading.enumerate()),
            shm=shm_names(),
            runtime_files=_files_under(default_runtime_dir()),
            extra_dirs={str(d): _files_under(d) for d in dirs},
        )

    def grown_since(self, before: Snapshot) -> dict[str, list[str]]:
        grown: dict[str, list[str]] = {}
        for name in ("children", "fds", "threads", "shm", "runtime_files"):
            new = sorted(getattr(self, name) - getattr(before, name))
            if new:
                grown[name] = new
        for d, files in self.extra_dirs.items():
            new = sorted(files - before.extra_dirs.get(d, frozenset()))
            if new:
                grown[d] = new
        return grown


def wait_settled(before: Snapshot, *dirs: Path, timeout: float = 10.0) -> dict[str, list[str]]:
    """What has grown since ``before``, after letting processes and threads wind down."""
    deadline = time.monotonic() + timeout
    while True:
        grown = Snapshot.take(*dirs).grown_since(before)
        if not grown or time.monotonic() > deadline:
            return grown
        time.sleep(0.05)
