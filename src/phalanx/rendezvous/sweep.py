"""Reclaiming generations whose owners are provably dead.

A sweep never touches a live owner's generation: it removes only what the owner
record proves dead (pid gone, pid reused, previous boot, or, for another host's
owner, a lease expired long ago). A dead generation is first *claimed* by renaming it
to ``.reclaim-<token>`` (atomic, so two sweepers never interleave on one), then its
shared-memory names and files are removed. Every failure is reported with path and
errno; a claimed directory left behind is finished by the next sweep.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from .generation import OWNER_FILE, RemovalFailure, remove_tree
from .owner import Liveness, OwnerRecord

__all__ = ["GenerationInfo", "SweepReport", "list_generations", "sweep"]

log = logging.getLogger("phalanx.rendezvous")

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "phx-"  # shared-memory names: phx-<generation token>-...
DEFAULT_LEASE_EXPIRY_S = 600.0
_STAGING_GRACE_S = 60.0  # a .new-* directory younger than this may still be in creation


@dataclass
class GenerationInfo:
    token: str
    path: str
    liveness: str
    owner: dict[str, object] | None
    files: int
    shm_names: int
    dead: bool

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


@dataclass
class SweepReport:
    runtime_dir: str
    generations_removed: list[str] = field(default_factory=list)
    files_removed: int = 0
    shm_removed: int = 0
    live_kept: int = 0
    failures: list[RemovalFailure] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {
            "runtime_dir": self.runtime_dir,
            "generations_removed": self.generations_removed,
            "files_removed": self.files_removed,
            "shm_removed": self.shm_removed,
            "live_kept": self.live_kept,
            "failures": [f.as_dict() for f in self.failures],
        }


def _token_of(name: str) -> str:
    for prefix in (".reclaim-", ".new-"):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _shm_names(token: str) -> list[Path]:
    try:
        return [SHM_DIR / n for n in os.listdir(SHM_DIR) if n.startswith(f"{SHM_PREFIX}{token}-")]
    except OSError:
        return []


def _judge(path: Path, lease_expiry_s: float) -> tuple[Liveness, OwnerRecord | None]:
    owner_path = path / OWNER_FILE
    try:
        owner = OwnerRecord.from_json(owner_path.read_bytes())
        lease = owner_path.stat().st_mtime
    except (OSError, ValueError, TypeError):
        # No owner record: a staging dir still being created, or debris. Only age decides.
        try:
            age = time.time() - path.stat().st_mtime
        except OSError:
            return Liveness.UNREADABLE, None
        return (Liveness.PID_GONE if age > _STAGING_GRACE_S else Liveness.UNREADABLE), None
    return owner.liveness(lease, lease_expiry_s), owner


def _entries(runtime_dir: Path) -> list[Path]:
    try:
        return sorted(p for p in runtime_dir.iterdir() if p.is_dir() and not p.is_symlink())
    except FileNotFoundError:
        return []


def list_generations(runtime_dir: Path,
                     lease_expiry_s: float = DEFAULT_LEASE_EXPIRY_S) -> list[GenerationInfo]:
    out = []
    for path in _entries(runtime_dir):
        liveness, owner = _judge(path, lease_expiry_s)
        files = sum(len(f) for _, _, f in os.walk(path))
        token = _token_of(path.name)
        out.append(GenerationInfo(token, str(path), liveness.value,
                                  owner.__dict__ if owner else None, files,
                                  len(_shm_names(token)), liveness.dead))
    return out


def sweep(runtime_dir: Path, lease_expiry_s: float = DEFAULT_LEASE_EXPIRY_S) -> SweepReport:
    """Remove every generation under ``runtime_dir`` whose owner is provably dead."""
    report = SweepReport(str(runtime_dir))
    for path in _entries(runtime_dir):
        # A .reclaim-* directory was judged dead when it was claimed; finish it.
        claimed_before = path.name.startswith(".reclaim-")
        liveness = Liveness.PID_GONE if claimed_before else _judge(path, lease_expiry_s)[0]
        if not liveness.dead:
            report.live_kept += 1
            continue
        token = _token_of(path.name)
        claimed = path
        if not claimed_before:
            claimed = runtime_dir / f".reclaim-{token}"
            try:
                os.rename(path, claimed)
            except FileNotFoundError:
                continue  # another sweeper claimed it first
            except OSError as err:
                report.failures.append(RemovalFailure(str(path), err))
                continue
        for shm in _shm_names(token):
            try:
                os.unlink(shm)
                report.shm_removed += 1
            except FileNotFoundError:
                continue
            except OSError as err:
                report.failures.append(RemovalFailure(str(shm), err))
        removed, failures = remove_tree(claimed)
        report.files_removed += removed
        report.failures.extend(failures)
        if not failures:
            report.generations_removed.append(token)
    for failure in report.failures:
        log.warning("phalanx sweep of %s: could not remove %r", runtime_dir, failure)
    return report
