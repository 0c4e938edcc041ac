"""``phalanx bench multihost`` (issue 16) at tiny counts (``--quick``) on real network
namespaces: its last line is the JSON object with every figure positive (the layouts'
2 x 2 all-reduce, phalanx serve's decode across 3 x 1 hosts (``--quick`` leaves 2 x 2
out: the same code) and phalanx's domain
cycle across the hosts beside gloo's included); its namespaces, processes and servers
are gone afterwards, also when it is stopped by SIGTERM mid-run; ``--no-decode`` leaves
decode out with its reason. Shapes only, never a timing."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from netns import namespaces_of_this_run, skip_reason

# a campaign (hosts on network namespaces, faults across ranks, a benchmark's quick
# run): the full suite runs it, the inner loop (-m 'not slow') does not
pytestmark = pytest.mark.slow

PHALANX = str(Path(sys.executable).parent / "phalanx")
RANK_MODULE = "phalanx_bench.multihost_rank"
SERVE_MODULE = "phalanx.serve.cli._main"
DECODE = {"tokens_per_s", "itl_ms_p50", "ttft_ms"}
MEASURED = {
    "link": ("veth", "loopback", {"rtt_us_p50", "bulk_mb_s"}),
    "rendezvous_ms": ("hosts", "one_host", {"ms_p50"}),
    "allreduce_us": ("hosts", "one_host", {"4KiB_us_p50", "64KiB_us_p50"}),
    "gloo_group_cycle_us": ("hosts", "one_host", {"us_p50"}),
    ("layouts", "2x2"): ("hosts", "one_host", {"4KiB_us_p50"}),
    ("layouts", "3x1"): ("hosts", "one_host", {"4KiB_us_p50"}),
    ("decode_tokens_per_s", "3x1"): ("hosts", "one_host", DECODE),
    "replication_jobs_per_s": ("hosts", "local", {"jobs_per_s", "jobs"}),
    "domain_cycle_across_hosts": ("phalanx", "gloo", {"us_p50"}),
}


def _start(*extra: str) -> subprocess.Popen[str]:
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    return subprocess.Popen([PHALANX, "bench", "multihost", "--quick", "--json", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _ranks_of(pid: int) -> list[psutil.Process]:
    """The benchmark's rank processes and servers still alive (its children, or orphans
    of it: a server's own ranks are its children, so an orphaned server is found)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if RANK_MODULE in cmd or SERVE_MODULE in cmd:
            try:
                if p.ppid() in (pid, 1) or pid in [a.pid for a in p.parents()]:
                    out.append(p)
            except psutil.NoSuchProcess:
                continue
    return out


def _numbers(x: Any) -> list[float]:
    if isinstance(x, dict):
        return [n for v in x.values() for n in _numbers(v)]
    assert isinstance(x, (int, float)) and not isinstance(x, bool), x
    return [float(x)]


@pytest.mark.timeout(600)
def test_quick_run_json_shape_and_nothing_left() -> None:
    proc = _start()
    out, err = _finish(proc, 560)
    if proc.returncode != 0 and "namespaces unavailable" in err:
        pytest.skip(err.strip().splitlines()[-1])
    assert proc.returncode == 0, err[-4000:]
    r = json.loads(out.strip().splitlines()[-1])
    for name, (side, anchor, metrics) in MEASURED.items():
        fig = r[name[0]][name[1]] if isinstance(name, tuple) else r[name]
        assert set(fig) == {side, anchor, f"ratio_{side}_over_{anchor}"}, (name, fig)
        for part in fig.values():
            assert set(part) == metrics, (name, part)
        assert all(n > 0 for n in _numbers(fig)), (name, fig)
    assert r["layouts"]["shared_memory_subgroup"] is None
    assert "shared memory" in r["layouts"]["shared_memory_subgroup_reason"]
    assert set(r["load_avg_1m"]) == {"start", "end"}
    assert "cores" in r["machine"]
    assert namespaces_of_this_run(proc.pid) == []
    assert _ranks_of(proc.pid) == []


@pytest.mark.timeout(300)
def test_sigterm_mid_run_leaves_no_namespace_or_process() -> None:
    proc = _start()
    try:
        deadline = time.monotonic() + 240
        # wait for the condition, not a time: a rank process running inside a namespace
        while not (namespaces_of_this_run(proc.pid) and _ranks_of(proc.pid)):
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            assert time.monotonic() < deadline, "no rank process started within 240 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = _finish(proc, 120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, err[-4000:]
    assert namespaces_of_this_run(proc.pid) == []
    assert _ranks_of(proc.pid) == []
