"""``cache inspect`` and ``cache verify`` over either one rank's store or the directory
``phalanx serve --prefix-cache-disk DIR`` writes: a store per rank (``DIR/rank-<i>/``,
``phalanx.replication.rank_directories``) and none at its top.

Read as one store, that directory was "0 records checked: ok" (exit 0) while a rank held
records with bad checksums (issue 45): operators give the commands the path they gave
the server. So a directory that is not a store itself but holds ``rank-<i>`` stores is
read rank by rank: each rank's report, and their total under the single store's keys
(file names relative to DIR: ``rank-1/<record>``), so a script reading ``records`` or
``ok`` reads the whole cache.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from phalanx.kvstore.audit import (
    InspectReport,
    VerifyReport,
    inspect_directory,
    is_store,
    verify_directory,
)

__all__ = ["inspect_json", "inspect_ranks", "rank_stores", "verify_json", "verify_ranks",
           "verify_ranks_json"]

_RANK_DIR = re.compile(r"rank-(0|[1-9][0-9]*)")
_COUNTS = ("records", "thinned", "bytes", "orphans", "thinnable", "temps")


def rank_stores(directory: str) -> dict[int, str]:
    """rank -> its store's path, by rank, when ``directory`` is a server's directory
    (not a store, holding ``rank-<i>`` directories); empty when it is one store."""
    if is_store(directory):
        return {}
    found: dict[int, str] = {}
    with os.scandir(directory) as it:
        for entry in it:
            m = _RANK_DIR.fullmatch(entry.name)
            if m is not None and entry.is_dir():
                found[int(m.group(1))] = entry.path
    return dict(sorted(found.items()))


def inspect_ranks(directory: str, stores: dict[int, str]
                  ) -> tuple[InspectReport, dict[int, InspectReport]]:
    """Every rank's report and their total (the geometry when the ranks agree on one)."""
    ranks = {r: inspect_directory(path) for r, path in stores.items()}
    geometries = [rep.geometry for rep in ranks.values()]
    same = all(g == geometries[0] for g in geometries)
    total = InspectReport(directory, geometries[0] if geometries and same else None)
    for field in _COUNTS:
        setattr(total, field, sum(getattr(rep, field) for rep in ranks.values()))
    hist: dict[str, int] = {}
    for r, rep in ranks.items():
        total.skipped += [(f"rank-{r}/{n}", why) for n, why in rep.skipped]
        for bucket, n in rep.depth_histogram.items():
            hist[bucket] = hist.get(bucket, 0) + n
    total.depth_histogram = dict(sorted(hist.items(), key=lambda kv: _bucket_low(kv[0])))
    return total, ranks


def _bucket_low(bucket: str) -> int:
    return int(bucket.split("-", 1)[0])


def verify_ranks(directory: str, stores: dict[int, str]
                 ) -> tuple[VerifyReport, dict[int, VerifyReport]]:
    """Every rank's verification and their total: a corrupt record of any rank makes
    the whole not ok, named ``rank-<i>/<record>``."""
    ranks = {r: verify_directory(path) for r, path in stores.items()}
    total = VerifyReport(directory, checked=sum(rep.checked for rep in ranks.values()))
    for r, rep in ranks.items():
        total.corrupt += [(f"rank-{r}/{n}", why) for n, why in rep.corrupt]
    return total, ranks


def verify_json(rep: VerifyReport) -> dict[str, Any]:
    """One store's verification as ``cache verify --json`` prints it."""
    return {"directory": rep.directory, "checked": rep.checked, "ok": rep.ok,
            "corrupt": [list(c) for c in rep.corrupt]}


def inspect_json(total: InspectReport, ranks: dict[int, InspectReport]) -> dict[str, Any]:
    """The total under one store's keys, each rank's report under ``ranks``."""
    return {**dataclasses.asdict(total),
            "ranks": {str(r): dataclasses.asdict(rep) for r, rep in ranks.items()}}


def verify_ranks_json(total: VerifyReport, ranks: dict[int, VerifyReport]
                      ) -> dict[str, Any]:
    """The total under one store's keys, each rank's verification under ``ranks``."""
    return {**verify_json(total), "ranks": {str(r): verify_json(rep)
                                            for r, rep in ranks.items()}}
