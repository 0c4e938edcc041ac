"""``phalanx cache synth`` and ``phalanx cache maintain``: the incident reproduced
without a model, and offline compaction, eviction and expiry for operators."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from phalanx.serve.cli._main import cli
from replication_util import assert_identical

# a campaign (hosts on network namespaces, faults across ranks, a benchmark's quick
# run): the full suite runs it, the inner loop (-m 'not slow') does not
pytestmark = pytest.mark.slow


def test_synth_then_maintain_compacts_every_rank(tmp_path: Path) -> None:
    d = tmp_path / "cache"
    runner = CliRunner()
    res = runner.invoke(cli, ["cache", "synth", str(d), "--tp", "3", "--records", "400",
                              "--shape", "chain", "--uncompacted"])
    assert res.exit_code == 0, res.output
    assert "350 redundant rows" in res.output
    res = runner.invoke(cli, ["cache", "maintain", str(d), "--tp", "3", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert out["jobs"] == {"thin": 350}
    assert out["records_before"] == out["records_after"] == {"0": 400, "1": 400, "2": 400}
    assert out["problems"] == []
    assert_identical(d)
    res = runner.invoke(cli, ["cache", "maintain", str(d), "--tp", "3", "--max-age", "0.001",
                              "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert out["records_after"] == {"0": 0, "1": 0, "2": 0}
    assert assert_identical(d) == []


def _rank_pids(parent: int) -> dict[int, int]:
    """rank -> pid of the rank processes started by process ``parent``."""
    out: dict[int, int] = {}
    for child in psutil.Process(parent).children():
        with contextlib.suppress(psutil.Error):
            rank = child.environ().get("PHALANX_RANK")
            if rank is not None:
                out[int(rank)] = child.pid
    return out


def _kv_bytes(directory: Path) -> int:
    return sum(e.stat().st_size for e in os.scandir(directory) if e.name.endswith(".kv"))


def test_maintain_exits_when_a_peer_is_stopped_mid_burst(tmp_path: Path) -> None:
    """The SIGSTOP hang (issue 13): the command exits 1 naming the peer within its
    deadlines, instead of when the peer is resumed."""
    d = tmp_path / "cache"
    res = CliRunner().invoke(cli, ["cache", "synth", str(d), "--tp", "3", "--records", "1200",
                                   "--uncompacted"])
    assert res.exit_code == 0, res.output
    before = _kv_bytes(d / "rank-1")
    # every peer applies slowly (5 ms an op): the burst of 1,050 thinnings lasts seconds
    env = dict(os.environ, PHALANX_FAILPOINTS="cache.replica.apply=delay:0.005")
    cmd = [sys.executable, "-c", "from phalanx.serve.cli._main import cli; cli()", "cache",
           "maintain", str(d), "--tp", "3", "--json", "--window", "8", "--job-timeout", "2",
           "--close-timeout", "5"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    stopped = 0
    try:
        deadline = time.monotonic() + 120
        while _kv_bytes(d / "rank-1") >= before:  # until rank 1 thinned a row: under way
            assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
            time.sleep(0.02)
        stopped = _rank_pids(proc.pid)[1]
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=2 + 5 + 5 + 30)  # job + close + worker + slack
        took = time.monotonic() - t0
    finally:
        if stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, (out, err)
    assert "LinkStalledError" in err and "peer rank 1" in err, err
    assert took < 40, took
