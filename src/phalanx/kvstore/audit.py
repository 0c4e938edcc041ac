"""Read-only views of a cache directory for operators: ``inspect`` and ``verify``.

Neither takes the directory lock nor changes a file, so both are safe beside a live
store (a record committed or removed meanwhile may show up as skipped "unreadable").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .index import Index
from .lock import LOCK_NAME
from .manifest import MANIFEST_NAME, read_manifest
from .record import RecordHeader, page_digest, record_name
from .recovery import build_index, scan

__all__ = ["InspectReport", "VerifyReport", "inspect_directory", "is_store",
           "verify_directory"]


@dataclass
class InspectReport:
    directory: str
    geometry: dict[str, object] | None
    records: int = 0  # attached (reachable) records
    thinned: int = 0
    bytes: int = 0  # every record file, orphans included
    orphans: int = 0  # records whose prefix is not cached: maintenance drops them
    thinnable: int = 0  # rows that maintenance would truncate to their header
    temps: int = 0
    depth_histogram: dict[str, int] = field(default_factory=dict)  # end page -> records
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, reason)


@dataclass
class VerifyReport:
    directory: str
    checked: int = 0  # record files whose header and every page CRC were checked
    corrupt: list[tuple[str, str]] = field(default_factory=list)  # (file, reason)

    @property
    def ok(self) -> bool:
        return not self.corrupt


def is_store(directory: str) -> bool:
    """Whether a store has opened ``directory`` (its manifest or lock is there): the
    operator commands read such a directory as one store, whatever else it holds."""
    return any(os.path.exists(os.path.join(directory, n)) for n in (MANIFEST_NAME, LOCK_NAME))


def _bucket(pages: int) -> str:
    lo = 1 << (pages.bit_length() - 1)
    return str(lo) if lo == 1 else f"{lo}-{2 * lo - 1}"


def _scan(directory: str) -> tuple[list[RecordHeader], list[str], list[tuple[str, str]], Index,
                                   dict[str, object] | None]:
    manifest = read_manifest(directory)
    geometry = manifest.geometry if manifest else None
    fingerprint = bytes.fromhex(manifest.fingerprint) if manifest else None
    res = scan(directory, geometry, fingerprint, progress=False)
    skipped = [*res.bad, *((n, "foreign_name") for n in res.foreign)]
    geo = None
    if geometry is not None:
        geo = {f: getattr(geometry, f) for f in geometry.__struct_fields__}
    return res.headers, res.temps, skipped, build_index(res.headers), geo


def inspect_directory(directory: str) -> InspectReport:
    headers, temps, skipped, index, geo = _scan(directory)
    rep = InspectReport(directory, geo, temps=len(temps), skipped=skipped)
    rep.records = len(index.records)
    rep.thinned = sum(1 for r in index.records.values() if r.thinned)
    rep.bytes = sum(h.file_len for h in headers)
    rep.orphans = len(index.orphans)
    rep.thinnable = len(index.thin_candidates)
    hist: dict[int, int] = {}
    for rec in index.records.values():
        hist[rec.end] = hist.get(rec.end, 0) + 1
    for pages in sorted(hist):
        b = _bucket(pages)
        rep.depth_histogram[b] = rep.depth_histogram.get(b, 0) + hist[pages]
    return rep


def verify_directory(directory: str) -> VerifyReport:
    """Check every record's header and every page of its row against its CRCs."""
    headers, _, skipped, _, _ = _scan(directory)
    rep = VerifyReport(directory, corrupt=[s for s in skipped if s[1] != "foreign_name"])
    for h in headers:
        rep.checked += 1
        if h.thinned:
            continue
        pb = h.geometry.page_bytes
        name = record_name(h.key)
        try:
            with open(os.path.join(directory, name), "rb") as f:
                f.seek(h.header_len)
                row = f.read(h.row_len)
        except OSError as exc:
            rep.corrupt.append((name, f"unreadable: {exc.strerror}"))
            continue
        digest = page_digest(h.version)
        for i, want in enumerate(h.crcs):
            if digest(row[i * pb : (i + 1) * pb]) != want:
                rep.corrupt.append((name, f"page {h.start_page + i} checksum"))
                break
    return rep
