"""The multi-host Worker and the per-host agents (issue 16), on real network namespaces.

Node 0 runs ``tests/hosts_job.py`` (a MultiHostWorker), every other node
``python -m phalanx.hosts.agent``; each in a namespace of its own with its own address
and runtime directory, so the hosts reach each other only over the veth links.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from netns import Host, hosts, namespaces_of_this_run

# a campaign (hosts on network namespaces, faults across ranks, a benchmark's quick
# run): the full suite runs it, the inner loop (-m 'not slow') does not
pytestmark = pytest.mark.slow

PORT = 29410
TOKEN = "test-job-token-16w"
TESTS = Path(__file__).resolve().parent
WAIT_S = 120.0  # guards a hang only: every wait inside has its own, shorter deadline


def _env(host: Host, tmp: Path, token: str = TOKEN) -> dict[str, str]:
    runtime = tmp / f"runtime-{host.index}"
    runtime.mkdir(mode=0o700, exist_ok=True)
    return {**os.environ, "PHALANX_JOB_TOKEN": token, "TORCH_CPP_LOG_LEVEL": "ERROR",
            "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
            "PHALANX_RUNTIME_DIR": str(runtime)}


def _start(nodes: list[Host], tmp: Path, scenario: str, rpn: int = 1,
           extra: list[str] | None = None) -> tuple[subprocess.Popen[bytes],
                                                     list[subprocess.Popen[bytes]]]:
    n, master = len(nodes), nodes[0].addr
    common = ["--nnodes", str(n), "--master-addr", master, "--master-port", str(PORT),
              "--ranks-per-node", str(rpn)]
    head = nodes[0].popen([sys.executable, str(TESTS / "hosts_job.py"), scenario, *common,
                           *(extra or [])], _env(nodes[0], tmp),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    agents = [h.popen([sys.executable, "-m", "phalanx.hosts.agent", *common, "--node-rank",
                       str(i), "--lost-after", "3"], _env(h, tmp),
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
              for i, h in enumerate(nodes) if i > 0]
    return head, agents


def _events(proc: subprocess.Popen[bytes]) -> tuple[list[dict[str, Any]], str]:
    out, err = proc.communicate(timeout=WAIT_S)
    return [json.loads(line) for line in out.decode().splitlines() if line.strip()], err.decode()


def _wait_event(proc: subprocess.Popen[bytes], name: str) -> dict[str, Any]:
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        assert line, f"node 0 ended before {name!r} (rc {proc.wait(WAIT_S)}): " \
                     f"{proc.stderr.read().decode()[-3000:] if proc.stderr else ''}"
        event = json.loads(line)
        if event.get("event") == name:
            return event


def _check_basic(nodes: list[Host], tmp: Path, rpn: int) -> None:
    head, agents = _start(nodes, tmp, "basic", rpn)
    events, err = _events(head)
    finals = [a.communicate(timeout=WAIT_S) for a in agents]
    assert head.returncode == 0, (events, err[-3000:])
    done = next(e for e in events if e["event"] == "done")
    world = len(nodes) * rpn
    assert [w["rank"] for w in done["where"]] == list(range(world))
    # each rank ran on its own host: the address its agent gave it
    assert [w["node_addr"] for w in done["where"]] == [nodes[r // rpn].addr
                                                     for r in range(world)]
    assert done["sums"] == [world * (world + 1) / 2] * world  # gloo across the hosts
    assert "defined in __main__" in done["errors"]["main"]
    assert "cannot cross hosts" in done["errors"]["opaque"]
    remote = done["errors"]["remote"]
    last = world - 1
    assert remote == (f"RemoteError: rank {last} on node {len(nodes) - 1} "
                      f"({nodes[-1].addr}): ValueError: no such thing")
    # an argument that is not what the function declares is refused where it arrives
    assert "hosts_job:where: argument 'rank': Expected `int`, got `str`" in \
        done["errors"]["typed"], done["errors"]
    for a, (_, aerr) in zip(agents, finals, strict=True):
        assert a.returncode == 0, aerr.decode()[-2000:]
        assert "node 0 closed the job" in aerr.decode()
    # the rendezvous left no key; the group's keys go with the group
    before, during, dropped, after = done["keys"]
    assert before == 0 and during == dropped > 0 and after == 0
    assert done["churn"] == [[during, during, 0]] * 3  # bounded by what is live
    _check_domains(done["domains"], world)
    closed = next(e for e in events if e["event"] == "closed")
    assert [t for t in closed["threads"] if t.startswith("phalanx")] == []


def _check_domains(got: dict[str, Any], world: int) -> None:
    """A domain spanning the hosts: one-sided puts and gets reached the other hosts'
    windows, every collective agreed, bad calls were refused by name, and churn and a
    member that never came left nothing behind."""
    for r, rd in enumerate(got["rounds"]):
        prev = (r - 1) % world
        assert rd["prev"] == 10 * prev and rd["put_by_prev"] == 100 + prev, rd
        assert rd["sum"] == world * (world + 1) / 2 and rd["max"] == world - 1, rd
        assert rd["prod"] == float(np.prod(np.arange(1, world + 1))), rd
        assert rd["root"] == 7 * (world - 1), rd
        assert rd["gathered"] == [[i, -i] for i in range(world)], rd
        outside, unmapped, no_rank, dtype = rd["refused"]
        assert "allreduce of uint16: gloo reduces" in dtype, rd
        assert "outside the 64-byte window of domain rank" in outside, rd
        assert "reached over the network, not mapped here" in unmapped, rd
        assert f"has no domain rank {world}" in no_rank, rd
    keys, threads = got["live"]
    assert keys > 0 and all(t >= 1 for t in threads), got["live"]  # a server per member
    late = got["late_error"]
    assert late is not None and "domain 'late' barrier" in late, late
    assert got["after"] == [0, [0] * world], got["after"]  # keys and threads all gone


def test_three_hosts_run_named_functions_and_a_gloo_group(tmp_path: Path) -> None:
    with hosts(3) as nodes:
        _check_basic(nodes, tmp_path, rpn=1)
    assert namespaces_of_this_run() == []


def test_a_killed_host_fails_its_ranks_at_once_and_stops_the_job(tmp_path: Path) -> None:
    marker = tmp_path / "release"  # never created: the tasks hold until the job ends
    with hosts(3) as nodes:
        head, agents = _start(nodes, tmp_path, "hold", extra=["--marker", str(marker)])
        _wait_event(head, "holding")
        killed_at = time.monotonic()
        agents[1].send_signal(signal.SIGKILL)  # node 2's agent; its ranks die with it
        events, _err = _events(head)
        took = time.monotonic() - killed_at
        done = next(e for e in events if e["event"] == "done")
        assert "HostLostError" in done["outcome"]["2"], done
        assert f"node 2 ({nodes[2].addr}), ranks [2], lost" in done["outcome"]["2"]
        assert "node 2" in done["dead"]
        _, aerr = agents[0].communicate(timeout=WAIT_S)
        assert agents[0].returncode == 1  # the surviving host exits non-zero...
        assert f"node 2 ({nodes[2].addr})" in aerr.decode()  # ...naming the lost node
        assert took < 60, took  # bounded (the held tasks would run 120 s)


def test_a_killed_head_stops_every_other_host(tmp_path: Path) -> None:
    marker = tmp_path / "release"
    with hosts(3) as nodes:
        head, agents = _start(nodes, tmp_path, "hold", extra=["--marker", str(marker)])
        _wait_event(head, "holding")
        head.send_signal(signal.SIGKILL)
        head.communicate(timeout=WAIT_S)
        for a in agents:
            _, aerr = a.communicate(timeout=WAIT_S)
            assert a.returncode == 1, aerr.decode()[-2000:]
            assert f"node 0 ({nodes[0].addr}" in aerr.decode() and "lost" in aerr.decode()


def test_the_recovered_chain_incident_across_three_hosts(tmp_path: Path) -> None:
    """docs/architecture.md's incident (a recovered cache whose every record needs maintenance) with
    each rank on a host of its own: the throttled burst crosses the veth links, completes,
    and leaves every host's directory identical."""
    from replication_util import assert_identical, dir_bytes, synth

    synth(tmp_path / "tpl", 1500, "chain")  # uncompacted: 7 of every 8 rows redundant
    cache = tmp_path / "cache"
    shutil.copytree(tmp_path / "tpl", cache)
    capacity = dir_bytes(cache / "rank-0") // 10
    with hosts(3) as nodes:
        head, agents = _start(nodes, tmp_path, "incident",
                              extra=["--cache", str(cache), "--capacity", str(capacity)])
        events, err = _events(head)
        for a in agents:
            a.communicate(timeout=WAIT_S)
        kinds = {e["event"]: e for e in events}
        assert "maintained" in kinds, (events, err[-3000:])
        assert sum(kinds["maintained"]["jobs"].values()) > 0
        assert kinds["maintained"]["problems"] == []
        assert head.returncode == 0 and all(a.returncode == 0 for a in agents)
    files = assert_identical(cache)
    assert 0 < sum(size for _, size in files) <= capacity


def test_a_partition_during_a_replication_burst_names_the_peer(tmp_path: Path) -> None:
    from replication_util import dir_bytes, synth

    synth(tmp_path / "tpl", 400, "chain")  # a burst that outlasts the cut's detection
    cache = tmp_path / "cache"
    shutil.copytree(tmp_path / "tpl", cache)
    marker = tmp_path / "cut"
    with hosts(3) as nodes:
        head, agents = _start(nodes, tmp_path, "incident",
                              extra=["--cache", str(cache), "--capacity",
                                     str(dir_bytes(cache / "rank-0") // 10),
                                     "--marker", str(marker)])
        _wait_event(head, "opened")
        nodes[2].link_down()
        marker.touch()  # the burst starts with node 2 cut off
        cut = time.monotonic()
        failed = _wait_event(head, "failed")
        assert f"node 2 ({nodes[2].addr})" in failed["error"], failed
        assert failed["seconds"] < 45  # lost_after (3 s) or the link's job timeout
        head.communicate(timeout=WAIT_S)
        assert head.returncode == 1  # the job failed: close says so
        for a in agents:
            a.communicate(timeout=WAIT_S)
            assert a.returncode == 1
        assert time.monotonic() - cut < 90
        nodes[2].link_up()


def test_same_host_ranks_keep_shared_memory_in_a_job_of_hosts(tmp_path: Path) -> None:
    """2 hosts x 2 ranks: each host's pair reduces over its own domain, the host sums
    cross over gloo; the same sums as gloo alone (the engine's answers are checked in
    test_hosts_serve), and the domains are released with nothing left."""
    with hosts(2) as nodes:
        head, agents = _start(nodes, tmp_path, "tiered", rpn=2, extra=["--iters", "20"])
        events, err = _events(head)
        for a in agents:
            a.communicate(timeout=WAIT_S)
        done = next((e for e in events if e["event"] == "done"), None)
        assert done is not None, (events, err[-3000:])
        assert done["released"] == [True, True] and done["keys"] == 0
        for per_rank in done["allreduce_us"].values():
            assert len(per_rank) == 4 and all(r["gloo"] > 0 and r["tiered"] > 0
                                              for r in per_rank)
        print("all-reduce µs per rank (gloo, tiered):",
              {n: [(round(r["gloo"]), round(r["tiered"])) for r in v]
               for n, v in done["allreduce_us"].items()})
        assert head.returncode == 0 and all(a.returncode == 0 for a in agents)
