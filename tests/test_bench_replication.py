"""``phalanx bench replication`` at tiny counts: its last line is the JSON object issue
13 item 10 names, each lane beside both local baselines (one store alone, and one
store per rank in its own process at once); and the all-ranks baseline reports a
store that fails to open as a ``BenchError`` and leaves no process behind. Shapes
only, never a timing: the machine is shared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from phalanx.kvstore import DiskStore, StoreOptions
from phalanx_bench._errors import BenchError
from phalanx_bench.replication_local import (
    FINGERPRINT,
    SMALL,
    Jobs,
    StagedRows,
    local_all_ranks,
    local_one_with_requests,
)

PHALANX = str(Path(sys.executable).parent / "phalanx")
TINY = ["--records", "100", "--stores", "4", "--burst", "300", "--requests", "4"]
LANE = {"jobs", "seconds", "jobs_per_s", "local_jobs", "local_jobs_per_s", "of_local",
        "local_all_ranks_jobs_per_s", "of_local_all_ranks", "local_all_ranks_of_local",
        "local_all_ranks_cores_busy", "cores_busy"}


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_lane_has_both_local_baselines() -> None:
    proc = subprocess.run([PHALANX, "bench", "replication", *TINY, "--json"],
                          capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("small", "store_1mib", "burst"):
        lane = r[name]
        assert all(_positive(lane[k]) for k in LANE), (name, lane)
        for runs in ("local_runs_jobs_per_s", "local_all_ranks_runs_jobs_per_s"):
            assert len(lane[runs]) == 2 and all(_positive(v) for v in lane[runs])
        assert {"0", "1", "2", "parent", "local", "local_all_ranks"} == set(
            lane["cpu_us_per_job"])
        assert lane["of_local_all_ranks"] == pytest.approx(
            lane["jobs_per_s"] / lane["local_all_ranks_jobs_per_s"], rel=0.01)
    assert r["small"]["local_jobs"] == r["small"]["jobs"] == 100
    assert r["store_1mib"]["local_jobs"] == 4
    req = r["requests_during_burst"]
    assert all(_positive(req[k]) for k in ("idle_p99_us", "burst_p99_us"))
    assert set(r["burst"]["peak_rss_mb"]) == {"0", "1", "2"}
    burst = r["burst"]
    assert burst["local_with_requests_requests"] >= 1
    assert burst["of_local_with_requests"] == pytest.approx(
        burst["jobs_per_s"] / burst["local_with_requests_jobs_per_s"], rel=0.01)


def test_the_baseline_with_requests_stores_them_beside_the_maintenance(
        tmp_path: Path) -> None:
    """The burst's third baseline stores its requests while it expires every record of
    the directory, and only the requests' records can be left."""
    d = str(tmp_path / "store")
    with DiskStore(d, SMALL, FINGERPRINT, StoreOptions(capacity_bytes=1 << 30)) as store:
        source = StagedRows(SMALL, 0)
        for i in range(50):
            chain = store.chain(np.arange(4 * SMALL.page_tokens) + 1000 * i)
            assert store.store(chain, source.row(chain.keys, 0)).stored
    run, requests = local_one_with_requests(d, 0.001)
    assert requests >= 1
    assert run.jobs >= 50  # every record of the directory expired (max_age 1 ms)
    with DiskStore(d, SMALL, FINGERPRINT, StoreOptions(capacity_bytes=1 << 30)) as store:
        # the requests' records, those not expired yet, are all that is left
        assert len(store.record_states()) <= 2 * requests


def test_a_store_that_cannot_open_fails_the_baseline_and_leaves_nothing(
        tmp_path: Path) -> None:
    ok, bad = tmp_path / "ok", tmp_path / "bad"
    bad.write_text("a file where a store directory should be")
    with pytest.raises(BenchError, match="store 1:"):
        local_all_ranks([str(ok), str(bad)], Jobs())
    left = [p for p in psutil.Process().children(recursive=True)
            if "phalanx_bench.replication_local" in " ".join(p.cmdline())]
    assert not left
