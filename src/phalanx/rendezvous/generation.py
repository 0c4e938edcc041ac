"""A generation: one Worker's life, one private directory ``<runtime_dir>/<token>/``.

The directory is published atomically: built as ``.new-<token>`` with its owner record
inside, then renamed into place, so a sweeper never sees a generation without an owner.
The owner record's mtime is the lease, refreshed by :meth:`Generation.heartbeat`, which
owners on other hosts are judged by.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from pathlib import Path

from phalanx.lifecycle.failpoints import Failpoint

from .owner import OwnerRecord
from .paths import check_private_dir, ensure_private_dir, write_private_file

__all__ = ["OWNER_FILE", "Generation", "RemovalFailure", "remove_tree"]

OWNER_FILE = "owner.json"

_UNLINK = Failpoint("rendezvous.remove.unlink", "about to unlink one file of a generation")


class RemovalFailure:
    __slots__ = ("errno", "path", "why")

    def __init__(self, path: str, err: OSError) -> None:
        self.path = path
        self.errno = err.errno
        self.why = err.strerror or str(err)

    def __repr__(self) -> str:
        name = errno.errorcode.get(self.errno or 0, str(self.errno))
        return f"{self.path}: {name} ({self.why})"

    def as_dict(self) -> dict[str, object]:
        return {"path": self.path, "errno": self.errno, "error": self.why}


def remove_tree(root: Path) -> tuple[int, list[RemovalFailure]]:
    """Remove ``root`` bottom-up; return (files removed, failures). Never raises, never
    ignores: every failure comes back with its path and errno."""
    removed = 0
    failures: list[RemovalFailure] = []

    def record(path: str, err: OSError) -> None:
        failures.append(RemovalFailure(path, err))

    for dirpath, dirnames, filenames in os.walk(
        root, topdown=False, onerror=lambda e: record(str(e.filename or root), e)
    ):
        failed_before = len(failures)
        # symlinks to directories are listed as dirnames but never walked into
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        for name in filenames + links:
            path = os.path.join(dirpath, name)
            try:
                _UNLINK.hit()
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                continue
            except OSError as err:
                record(path, err)
        try:
            os.rmdir(dirpath)
        except FileNotFoundError:
            continue
        except OSError as err:
            if len(failures) == failed_before:  # not just the echo of a file that stayed
                record(dirpath, err)
    return removed, failures


class Generation:
    """The on-disk presence of one Worker generation on this host."""

    def __init__(self, runtime_dir: Path, token: str) -> None:
        self.runtime_dir = runtime_dir
        self.token = token
        self.path = runtime_dir / token
        self.owner_path = self.path / OWNER_FILE

    @classmethod
    def create(cls, runtime_dir: Path, token: str) -> Generation:
        ensure_private_dir(runtime_dir)
        gen = cls(runtime_dir, token)
        staging = runtime_dir / f".new-{token}"
        os.mkdir(staging, 0o700)
        try:
            write_private_file(staging / OWNER_FILE, OwnerRecord.of_this_process().to_json())
            os.rename(staging, gen.path)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)  # ours, seconds old, never published
            raise
        check_private_dir(gen.path)
        return gen

    def heartbeat(self) -> None:
        """Refresh the lease that owners on other hosts are judged by."""
        now = time.time()
        os.utime(self.owner_path, (now, now))

    def remove(self) -> None:
        """Remove the generation directory; raise with every path and errno that failed."""
        if not self.path.exists():
            return
        _, failures = remove_tree(self.path)
        if failures:
            raise OSError(
                failures[0].errno,
                f"could not remove generation {self.token} under {self.runtime_dir}: "
                f"{'; '.join(map(repr, failures))}. `phalanx doctor --reclaim` retries",
            )
