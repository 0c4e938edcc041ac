"""The runtime directory: where it is, and making sure it is ours and private.

Directories are 0700 and files 0600. A symlink where a directory belongs, or a
directory owned by another user, is refused: a shared /tmp is hostile ground.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ._errors import UnsafeRuntimeDirError

__all__ = ["default_runtime_dir", "ensure_private_dir", "write_private_file"]

ENV_VAR = "PHALANX_RUNTIME_DIR"


def default_runtime_dir() -> Path:
    """``$PHALANX_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/phalanx``, else ``/tmp/phalanx-<uid>``."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "phalanx" if xdg else Path(f"/tmp/phalanx-{os.getuid()}")


def check_private_dir(path: Path) -> None:
    """Refuse ``path`` unless it is a real directory owned by us; tighten its mode to 0700."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeRuntimeDirError(
            f"{path} is a symlink; phalanx refuses to follow it for its runtime files. "
            f"Remove it or set PHALANX_RUNTIME_DIR to a directory you own"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeRuntimeDirError(f"{path} exists and is not a directory; remove it or choose "
                                    f"another runtime dir (PHALANX_RUNTIME_DIR)")
    if st.st_uid != os.getuid():
        raise UnsafeRuntimeDirError(
            f"{path} is owned by uid {st.st_uid}, not by us (uid {os.getuid()}); phalanx will "
            f"not put its files there. Set PHALANX_RUNTIME_DIR to a directory you own"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) 0700 if needed, then :func:`check_private_dir` it."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        return ensure_private_dir(path)
    check_private_dir(path)
    return path


def write_private_file(path: Path, data: bytes) -> None:
    """Publish ``data`` at ``path`` atomically (temp file, then rename), mode 0600."""
    tmp = path.with_name(f".tmp.{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    try:
        os.rename(tmp, path)
    except OSError:
        os.unlink(tmp)
        raise
