"""Several hosts meet (issue 16): ``python -m phalanx.hosts.probe`` in network namespaces.

Each namespace of tests/netns.py is a host with its own address; node 0 (10.77.0.1)
hosts the TCPStore. Every probe is a real process in its own namespace, so the nodes
reach each other only over the veth pairs and the bridge.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest

from netns import Host, hosts, namespaces_of_this_run

# a campaign (hosts on network namespaces, faults across ranks, a benchmark's quick
# run): the full suite runs it, the inner loop (-m 'not slow') does not
pytestmark = pytest.mark.slow

PORT = 29400  # each test's namespaces are new: nothing else listens there
TOKEN = "test-job-token-16"
WAIT_S = 45.0  # a probe's own deadlines are far shorter: this only guards a hang


def _probe(host: Host, rank: int, nnodes: int, token: str = TOKEN,
           timeout: float = 20.0) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PHALANX_JOB_TOKEN": token, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    argv = [sys.executable, "-m", "phalanx.hosts.probe", "--nnodes", str(nnodes),
            "--node-rank", str(rank), "--master-addr", f"{host.addr.rsplit('.', 1)[0]}.1",
            "--master-port", str(PORT), "--timeout", str(timeout)]
    return host.popen(argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _result(proc: subprocess.Popen[bytes]) -> tuple[int, dict[str, Any], str]:
    """Exit status, the JSON line, stderr."""
    out, err = proc.communicate(timeout=WAIT_S)
    lines = out.decode().strip().splitlines()
    assert lines, f"no output (rc {proc.returncode}); stderr:\n{err.decode()[-2000:]}"
    return proc.returncode, json.loads(lines[-1]), err.decode()


def test_three_hosts_meet_and_leave_no_key() -> None:
    with hosts(3) as nodes:
        procs = [_probe(h, i, 3) for i, h in enumerate(nodes)]
        results = [_result(p) for p in procs]
        want = [{"node_rank": i, "addr": h.addr} for i, h in enumerate(nodes)]
        for i, (rc, line, err) in enumerate(results):
            assert rc == 0, (i, line, err[-2000:])
            assert line["ok"] and line["node_rank"] == i and line["master"] == f"10.77.0.1:{PORT}"
            assert [{"node_rank": p["node_rank"], "addr": p["addr"]} for p in line["peers"]] == want
            assert [p["pid"] for p in line["peers"]] == [p["pid"] for p in results[0][1]["peers"]]
        assert results[0][1]["store_keys_after"] == 0  # every key of the handshake deleted
        assert [line["store_keys_after"] for _, line, _ in results[1:]] == [None, None]
    assert namespaces_of_this_run() == []


def test_a_wrong_token_is_refused_on_both_sides_and_the_others_are_told() -> None:
    with hosts(3) as nodes:
        procs = [_probe(nodes[0], 0, 3), _probe(nodes[1], 1, 3, token="not-the-token"),
                 _probe(nodes[2], 2, 3)]
        (rc0, head, _), (rc1, bad, _), (rc2, other, _) = (_result(p) for p in procs)
    assert (rc0, rc1, rc2) == (1, 1, 1), (head, bad, other)
    assert head["error"] == "TokenMismatchError", head
    assert "node 1 at 10.77.0.2" in head["message"] and "PHALANX_JOB_TOKEN" in head["message"]
    assert bad["error"] == "TokenMismatchError", bad
    assert "node 1 at 10.77.0.2 was refused by node 0 at 10.77.0.1" in bad["message"], bad
    # the third node was admitted by nobody: it hears that node 1 was refused, and why
    assert other["error"] == "RendezvousError", other
    assert "node 1 at 10.77.0.2" in other["message"] and "token" in other["message"], other
    assert TOKEN not in json.dumps([head, bad, other])  # the token never travels or prints
    assert namespaces_of_this_run() == []


def test_a_node_that_never_arrives_is_named_and_a_duplicate_rank_is_refused() -> None:
    """Rank 2 never starts; rank 1 starts on two hosts. Node 0 names rank 2 at its
    deadline, to itself and to the rank 1 that claimed first; the other rank 1 is told
    at once whose address holds its rank (it never reads the winner's verdict)."""
    with hosts(3) as nodes:
        # 8 s: long enough for the others to import torch and connect on a loaded machine
        procs = [_probe(nodes[0], 0, 3, timeout=8), _probe(nodes[1], 1, 3, timeout=8),
                 _probe(nodes[2], 1, 3, timeout=8)]
        (rc0, head, _), first, second = (_result(p) for p in procs)
    assert rc0 == 1, head
    winner = "10.77.0.2" if "1 at 10.77.0.2" in head["message"] else "10.77.0.3"
    (rc1, node1, _), (rc_dup, dup, _) = (first, second) if winner == "10.77.0.2" else (
        second, first)
    for rc, line in ((rc0, head), (rc1, node1)):
        assert rc == 1, line
        assert line["error"] == "HandshakeTimeoutError" and line["missing"] == [2], line
        assert "node rank(s) [2] never arrived within 8s" in line["message"], line
        assert f"master 10.77.0.1:{PORT}" in line["message"], line
    assert f"arrived: 0 at 10.77.0.1, 1 at {winner}" in head["message"], head
    assert rc_dup == 1 and dup["error"] == "RendezvousError", dup
    assert f"node rank 1 is taken by the node at {winner}" in dup["message"], dup
    assert namespaces_of_this_run() == []


def test_the_harness_tears_down_when_the_body_fails() -> None:
    """A failing body: its processes are killed and its namespaces deleted all the same."""
    started: list[subprocess.Popen[bytes]] = []
    try:
        with hosts(2) as nodes:
            started.append(nodes[1].popen(["sleep", "600"]))
            raise KeyError("the body failed")
    except KeyError:
        pass
    assert started[0].returncode is not None  # killed and reaped by the teardown
    assert namespaces_of_this_run() == []


def test_a_host_cut_off_by_a_partition_is_named_and_fails_itself() -> None:
    """Node 2's link is down (tests/netns.py's partition): the others name it; it says it
    cannot reach node 0's store."""
    with hosts(3) as nodes:
        nodes[2].link_down()
        started = time.monotonic()
        procs = [_probe(h, i, 3, timeout=8) for i, h in enumerate(nodes)]
        cut_result = _result(procs[2])
        cut_s = time.monotonic() - started  # torch's import (~2 s), then the 8 s deadline
        (_, head, _), (_, node1, _) = (_result(p) for p in procs[:2])
        nodes[2].link_up()
    rc2, cut, _ = cut_result
    # bounded: torch's own client overshot an 8 s connect timeout to 13 s (hosts._connect)
    assert cut_s < 8 + 10, f"the cut-off node took {cut_s:.1f}s to give up"
    assert head["missing"] == [2] and node1["missing"] == [2], (head, node1)
    assert rc2 == 1 and cut["error"] == "RendezvousError", cut
    assert f"node 2 at 10.77.0.3: node 0's store at 10.77.0.1:{PORT} cannot be reached " \
           f"within 8s" in cut["message"], cut
    assert namespaces_of_this_run() == []

