"""``DIR/phalanx-cache.json``: what the directory was made for, checked at open.

A directory from another model or geometry is refused as a whole, with a clear error,
before any record is touched; per-record headers are still checked during recovery.
"""

from __future__ import annotations

import os

import msgspec

from ._errors import ForeignStoreError, GeometryMismatchError
from .geometry import Geometry
from .record import READABLE_VERSIONS, RECORD_VERSION

__all__ = ["MANIFEST_NAME", "Manifest", "check_or_create", "read_manifest"]

MANIFEST_NAME = "phalanx-cache.json"


class Manifest(msgspec.Struct, frozen=True):
    version: int
    geometry: Geometry
    fingerprint: str  # hex of the 16-byte digest


def read_manifest(directory: str) -> Manifest | None:
    path = os.path.join(directory, MANIFEST_NAME)
    try:
        with open(path, "rb") as f:
            return msgspec.json.decode(f.read(), type=Manifest)
    except FileNotFoundError:
        return None
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise ForeignStoreError(
            f"{path} is not a phalanx cache manifest ({exc}); this directory is not a "
            "phalanx cache: pick another directory"
        ) from exc


def check_or_create(directory: str, geometry: Geometry, fingerprint: bytes) -> None:
    want = Manifest(RECORD_VERSION, geometry, fingerprint.hex())
    have = read_manifest(directory)
    if have is None:
        _write(directory, want)
        return
    # the manifest names the format the directory was made with; records of every
    # readable format are served, and new ones are written in the current format
    if have.version not in READABLE_VERSIONS or have.geometry != want.geometry:
        raise GeometryMismatchError(
            f"cache directory {directory} holds format v{have.version} rows of "
            f"{have.geometry}, this store reads formats {list(READABLE_VERSIONS)} of "
            f"{geometry}; "
            "use another directory, or delete this one to start afresh"
        )
    if have.fingerprint != want.fingerprint:
        raise ForeignStoreError(
            f"cache directory {directory} belongs to model fingerprint {have.fingerprint}, "
            f"not {want.fingerprint}; use a directory per model"
        )
    if have.version < RECORD_VERSION:
        # this store writes the current format into it: from now on a build that cannot
        # read it refuses the directory at open, instead of skipping every new record
        # (and, with bad_files="delete", deleting them); it cannot trust our seal either
        _write(directory, want)


def _write(directory: str, manifest: Manifest) -> None:
    path = os.path.join(directory, MANIFEST_NAME)
    tmp = os.path.join(directory, f".{MANIFEST_NAME}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, msgspec.json.encode(manifest))
    finally:
        os.close(fd)
    os.rename(tmp, path)
