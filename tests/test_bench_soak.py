"""Smoke test of ``phalanx bench soak`` at a tiny size: a real server, the whole mix
(bad requests, disconnects mid-stream), the JSON object's shape, no 5xx, and nothing
left behind (the server and its ranks reaped, the temporary directory gone). Shapes
only, never a memory figure: 60 requests are all warm-up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from phalanx_bench.soak import slope_per_1k

PHALANX = str(Path(sys.executable).parent / "phalanx")


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def test_slope_is_least_squares_per_1k() -> None:
    assert slope_per_1k([(1000, 10.0), (2000, 12.0), (3000, 14.0)]) == 2.0
    assert slope_per_1k([(1000, 10.0), (2000, 13.0), (3000, 13.0)]) == 1.5
    assert slope_per_1k([(1000, 10.0)]) is None


@pytest.mark.slow  # a benchmark's quick run, as the other bench smoke tests
def test_soak_json_shape_and_no_5xx() -> None:
    proc = subprocess.run([PHALANX, "bench", "soak", "--requests", "60", "--report-every",
                           "20", "--json"], capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["requests"] == 60 and sum(r["statuses"].values()) == 60
    assert r["status_5xx"] == 0 and r["no_response"] == 0, r["unexpected"]
    assert r["bad_not_4xx"] == 0 and r["not_whole"] == {}, r["unexpected"]
    # the mix: every 10th dropped mid-stream, the bad one (index 50) refused with a 4xx
    assert r["kinds"]["disconnect"] == 6 and r["kinds"]["unknown_model"] == 1
    assert r["statuses"].get("404") == 1
    assert r["kinds"]["chat"] > 0 and r["kinds"]["completion"] > 0
    assert [x["requests"] for x in r["reports"]] == [0, 20, 40, 60]
    procs = r["processes"]
    assert set(procs) == {"server", "rank 0", "rank 1"}
    for row in procs.values():
        assert row["reports"] == 3
        assert all(_number(row[k]) for k in ("rss_mb_first", "rss_mb_last", "rss_mb_per_1k"))
        assert row["rss_mb_first"] > 0
    assert r["server_exit_code"] == 0
    # nothing left: the temporary directory (disk tier, log), the server and its ranks
    assert not Path(r["scratch"]).exists()
    assert [name for name, row in procs.items() if _running(row["pid"], row["create_time"])
            ] == []


def _running(pid: int, created: float) -> bool:
    """Whether that very process (not a later one given its pid) still runs."""
    try:
        p = psutil.Process(pid)
        return p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
