"""kill -9 of a writer process at random points: the reopened store serves only
complete, checksum-valid records, and nothing but temp files (purged) is left over."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cache_util import GEOM, Stores, page_row, record_files, stores, temp_files
from cache_writer import prefixes
from phalanx.kvstore.audit import verify_directory

__all__ = ["stores"]

WRITER = str(Path(__file__).with_name("cache_writer.py"))
KILLS = 35  # trials that really died by SIGKILL; some armed points are never reached
MAX_TRIALS = 80
PER_TRIAL = 40
KILL_POINTS = [
    "cache.store.temp_opened", "cache.store.temp_written", "cache.store.committed",
    "cache.thin.temp_written", "cache.thin.committed", "cache.remove.unlinking",
    "cache.purge.unlinking",
]


def _run_writer(d: Path, trial: int, rnd: random.Random) -> str:
    env = dict(os.environ)
    how = "signal"
    if trial % 2:  # half the trials die exactly at a write/commit/delete step
        point = KILL_POINTS[trial // 2 % len(KILL_POINTS)]
        env["PHALANX_FAILPOINTS"] = f"{point}=kill@{rnd.randrange(0, 12)}"
        how = point
    proc = subprocess.Popen([sys.executable, WRITER, str(d), str(trial), str(PER_TRIAL)],
                            stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        if how == "signal":  # the others may also die by SIGKILL, from their failpoint
            # die somewhere inside the store loop (each iteration is ~1 ms)
            try:
                proc.wait(timeout=rnd.uniform(0.0, 0.06))
            except subprocess.TimeoutExpired:
                proc.kill()
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()
    assert rc in (0, -signal.SIGKILL), f"writer failed with {rc} ({how})"
    return how if rc else "finished"


@pytest.mark.slow
def test_kill9_leaves_only_complete_valid_records(tmp_path: Path, stores: Stores) -> None:
    rnd = random.Random(1234)
    outcomes: dict[str, int] = {}
    trial = -1
    while sum(v for k, v in outcomes.items() if k != "finished") < KILLS:
        trial += 1
        assert trial < MAX_TRIALS, outcomes
        how = _run_writer(tmp_path, trial, rnd)
        outcomes[how] = outcomes.get(how, 0) + 1
        # the directory as the crash left it: every record file complete and valid
        report = verify_directory(str(tmp_path))
        assert report.ok, (trial, how, report.corrupt)
        s = stores.open(tmp_path, capacity_bytes=48 * 1024)
        assert s.statistics().skipped == {}
        left = temp_files(tmp_path)  # what the crash left: maintenance purges it
        while s.poll():
            pass
        assert temp_files(tmp_path) == [] and s.check() == []
        assert s.statistics().temps_purged == len(left)
        # whatever is served is exactly the bytes of its tokens
        pt = GEOM.page_tokens
        for seed in range(trial + 1):
            for toks in prefixes(seed, PER_TRIAL):
                n = s.lookup(toks)
                if n:
                    assert bytes(s.load(toks, n)) == page_row(toks[: n * pt])
        s.close()
    assert len(outcomes) >= 6, outcomes  # died at many different steps
    assert record_files(tmp_path)  # the trials did store something
