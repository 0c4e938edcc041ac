"""``phalanx bench multihost``: across hosts vs one host, on real network namespaces.

Three hosts x one rank: :mod:`phalanx_bench.netns` makes three namespaces (10.77.0.1-3)
on one bridge, and every measurement runs in processes started inside them (``ip netns
exec ... python -m phalanx_bench.multihost_rank MODE``), so the hosts reach each other
only over their veth pairs and the bridge. The one-host side of each figure is the same
three processes in host 0's namespace, over its loopback. Each figure is one function
that measures one side once; a run visits every figure's two sides in turn, ``--repeats``
times (the order of the sides alternating, so a shared machine's drift hits both), and
reports the median over the repeats of each repeat's own median, with the ratio of the
two sides of the same run.

Figures: the link itself (TCP ping-pong latency and bulk bandwidth, veth vs loopback),
node rendezvous (``phalanx.hosts.rendezvous``), torch.distributed gloo all-reduce and
gloo ``new_group`` + ``barrier`` + ``destroy_process_group`` cycles (the anchor of
phalanx's domain cycle, the same loop as ``bench domains``). Figures of parts not built
yet are ``null`` with a ``<name>_reason``: each becomes a function in ``FIGURES`` when
its part exists. Nothing is left behind: the namespaces' teardown kills every process
started in them, the processes die with this one (``die_with_parent``), SIGTERM unwinds
through the teardown, and namespaces of an earlier run that was killed are swept first.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import selectors
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import click

from ._errors import BenchError
from ._stats import emit
from .netns import Host, NetnsUnavailable, hosts, sweep_stale

NODES = 3
_LAUNCH_TIMEOUT_S = 180.0  # one launch: torch's import on 3 processes of a loaded VM
_RANK_MODULE = "phalanx_bench.multihost_rank"


class _NotBuilt(Exception):
    """A figure whose part of phalanx does not exist yet: reported null with the reason."""


@dataclass
class _Ctx:
    nodes: list[Host]
    opts: dict[str, Any]
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    ports: Iterator[int] = field(default_factory=lambda: itertools.count(29500, 50))

    def layout(self, side: str) -> tuple[list[Host], str, str]:
        """The hosts of each rank, node 0's address and gloo's interface for a side."""
        if side == "hosts":
            return self.nodes[:NODES], self.nodes[0].addr, "eth0"
        return [self.nodes[0]] * NODES, "127.0.0.1", "lo"

    def env(self, ifname: str) -> dict[str, str]:
        return {**os.environ, "PHALANX_JOB_TOKEN": self.token, "TORCH_CPP_LOG_LEVEL": "ERROR",
                "GLOO_SOCKET_IFNAME": ifname, "OMP_NUM_THREADS": "1"}


def _launch(ctx: _Ctx, what: str, jobs: list[tuple[Host, list[str]]],
            ifname: str) -> list[dict[str, Any]]:
    """Run one process per job in its host's namespace; each one's JSON line, in order.

    Reads every pipe as it comes, so the first process to fail is reported at once
    (naming its host, mode and stderr) rather than after its peers' own timeouts."""
    procs = [host.popen([sys.executable, "-m", _RANK_MODULE, *argv], ctx.env(ifname),
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for host, argv in jobs]
    bufs = [[bytearray(), bytearray()] for _ in procs]
    open_pipes = [2] * len(procs)
    deadline = time.monotonic() + _LAUNCH_TIMEOUT_S
    sel = selectors.DefaultSelector()

    def who(i: int) -> str:
        return f"{what}: process {i} ({jobs[i][1][0]}, pid {procs[i].pid}) on {jobs[i][0].name}"

    try:
        for i, p in enumerate(procs):
            assert p.stdout is not None and p.stderr is not None
            sel.register(p.stdout, selectors.EVENT_READ, (i, 0))
            sel.register(p.stderr, selectors.EVENT_READ, (i, 1))
        while any(open_pipes):
            left = deadline - time.monotonic()
            if left <= 0:
                late = [who(i) for i, n in enumerate(open_pipes) if n]
                raise BenchError(f"still running after {_LAUNCH_TIMEOUT_S:g}s: {late}")
            for key, _ in sel.select(left):
                i, k = key.data
                data = os.read(key.fd, 1 << 16)
                if data:
                    bufs[i][k] += data
                    continue
                sel.unregister(key.fileobj)
                open_pipes[i] -= 1
                if open_pipes[i] == 0 and procs[i].wait(10) != 0:
                    raise BenchError(f"{who(i)} exited {procs[i].returncode}: "
                                     f"{bufs[i][1].decode(errors='replace')[-3000:]}")
        return [json.loads(out.decode().strip().splitlines()[-1]) for out, _ in bufs]
    finally:
        sel.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
            for stream in (p.stdout, p.stderr):
                if stream is not None:
                    stream.close()


# -- the figures: each measures one side once ------------------------------------------


def _link(ctx: _Ctx, side: str) -> dict[str, float]:
    """TCP between host 1 and host 0 over the veth pairs, or inside host 0's loopback."""
    o = ctx.opts
    port = next(ctx.ports)
    server_host, client_host = ctx.nodes[0], ctx.nodes[1] if side == "veth" else ctx.nodes[0]
    addr = server_host.addr if side == "veth" else "127.0.0.1"
    common = ["--port", str(port), "--pings", str(o["pings"]),
              "--bulk-bytes", str(o["bulk_mib"] << 20), "--bulk-reps", str(o["bulk_reps"])]
    _, client = _launch(ctx, f"link ({side})",
                        [(server_host, ["tcp-server", "--bind", addr, *common]),
                         (client_host, ["tcp-client", "--addr", addr, *common])], "lo")
    return {"rtt_us_p50": client["rtt_us_p50"], "bulk_mb_s": client["bulk_mb_s"]}


def _rendezvous(ctx: _Ctx, side: str) -> dict[str, float]:
    """``phalanx.hosts.rendezvous`` of 3 nodes: from node 0's store listening to the last
    node's return, per round (round 0 left out: the first connect of each process)."""
    rounds = ctx.opts["rendezvous_rounds"]
    nodes, master, ifname = ctx.layout(side)
    sync_port = next(ctx.ports)
    port = sync_port + 1  # rounds use port .. port + rounds - 1 (ports step by 50)
    lines = _launch(ctx, f"rendezvous ({side})", [
        (h, ["rendezvous", "--nnodes", str(NODES), "--rank", str(r), "--master-addr", master,
             "--port", str(port), "--sync-port", str(sync_port), "--rounds", str(rounds)])
        for r, h in enumerate(nodes)], ifname)
    by_rank = {line["rank"]: line for line in lines}
    times = [max(by_rank[r]["ends"][k] for r in by_rank) - by_rank[0]["starts"][k]
             for k in range(rounds)]
    timed = times[1:] or times
    return {"ms_p50": statistics.median(timed) * 1e3}


def _gloo(ctx: _Ctx, side: str, mode: str, extra: list[str]) -> dict[str, Any]:
    nodes, master, ifname = ctx.layout(side)
    port = next(ctx.ports)
    lines = _launch(ctx, f"{mode} ({side})", [
        (h, [mode, "--world", str(NODES), "--rank", str(r), "--master-addr", master,
             "--port", str(port), *extra]) for r, h in enumerate(nodes)], ifname)
    rank0: dict[str, Any] = next(line for line in lines if line["rank"] == 0)
    return rank0


def _allreduce(ctx: _Ctx, side: str) -> dict[str, float]:
    """gloo all-reduce of float32 tensors across the 3 ranks: rank 0's median per size."""
    sizes: list[int] = ctx.opts["allreduce_bytes"]
    got = _gloo(ctx, side, "allreduce", ["--sizes", ",".join(map(str, sizes)),
                                         "--iters", str(ctx.opts["allreduce_iters"])])
    return {f"{_kib(s)}_us_p50": got[str(s)] for s in sizes}


def _group_cycle(ctx: _Ctx, side: str) -> dict[str, float]:
    """gloo ``new_group`` + ``barrier(group)`` + ``destroy_process_group(group)``."""
    got = _gloo(ctx, side, "group-cycle", ["--cycles", str(ctx.opts["cycles"])])
    return {"us_p50": got["us_p50"]}


def _phalanx_domain_cycle(ctx: _Ctx, side: str) -> dict[str, float]:
    raise _NotBuilt("phalanx domains spanning hosts do not exist yet (issue 16, Data paths); "
                    "gloo_group_cycle_us is the anchor they will be compared against")


def _decode_tokens_per_s(ctx: _Ctx, side: str) -> dict[str, float]:
    raise _NotBuilt("the multi-host engine (src/phalanx/hosts, src/phalanx/engine) is being "
                    "built; decode across 3 hosts vs one host is measured here once "
                    "phalanx.LLM runs on several hosts")


def _replication_jobs_per_s(ctx: _Ctx, side: str) -> dict[str, float]:
    raise _NotBuilt("replication links across hosts are not built yet (issue 16, Data "
                    "paths: cache); measured here vs the local baseline once they are")


@dataclass(frozen=True)
class _Figure:
    measure: Callable[[_Ctx, str], dict[str, float]]
    sides: tuple[str, str]  # (measured, anchor): the ratio is measured / anchor


FIGURES: dict[str, _Figure] = {
    "link": _Figure(_link, ("veth", "loopback")),
    "rendezvous_ms": _Figure(_rendezvous, ("hosts", "one_host")),
    "allreduce_us": _Figure(_allreduce, ("hosts", "one_host")),
    "gloo_group_cycle_us": _Figure(_group_cycle, ("hosts", "one_host")),
    "phalanx_domain_cycle_across_hosts": _Figure(_phalanx_domain_cycle,
                                                 ("hosts", "one_host")),
    "decode_tokens_per_s": _Figure(_decode_tokens_per_s, ("hosts", "one_host")),
    "replication_jobs_per_s": _Figure(_replication_jobs_per_s, ("hosts", "local")),
}


def _kib(n: int) -> str:
    return f"{n >> 10}KiB" if n % 1024 == 0 else f"{n}B"


def _summary(fig: _Figure, runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    a, b = fig.sides
    med = {side: {m: round(statistics.median(r[m] for r in runs[side]), 1)
                  for m in runs[side][0]} for side in fig.sides}
    ratios = {m: round(med[a][m] / med[b][m], 2) for m in med[a]}
    return {a: med[a], b: med[b], f"ratio_{a}_over_{b}": ratios}


def _measure(ctx: _Ctx, repeats: int) -> dict[str, Any]:
    runs: dict[str, dict[str, list[dict[str, float]]]] = {}
    not_built: dict[str, str] = {}
    for rep in range(repeats):
        for name, fig in FIGURES.items():
            if name in not_built:
                continue
            for side in fig.sides if rep % 2 == 0 else fig.sides[::-1]:
                try:
                    got = fig.measure(ctx, side)
                except _NotBuilt as exc:
                    not_built[name] = str(exc)
                    break
                runs.setdefault(name, {}).setdefault(side, []).append(got)
    out: dict[str, Any] = {}
    for name, fig in FIGURES.items():
        if name in not_built:
            out[name], out[f"{name}_reason"] = None, not_built[name]
        else:
            out[name] = _summary(fig, runs[name])
    return out


def _unwind(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # through the namespaces' teardown, not around it


@click.command("multihost")
@click.option("--repeats", default=3, show_default=True)
@click.option("--pings", default=2000, show_default=True, help="TCP ping-pongs per run.")
@click.option("--bulk-mib", default=64, show_default=True)
@click.option("--bulk-reps", default=3, show_default=True)
@click.option("--rendezvous-rounds", default=6, show_default=True)
@click.option("--allreduce-bytes", default="4096,65536", show_default=True)
@click.option("--allreduce-iters", default=2000, show_default=True)
@click.option("--cycles", default=100, show_default=True, help="gloo group cycles.")
@click.option("--quick", is_flag=True, help="Tiny counts: checks the shape, not a figure.")
@click.option("--json", "as_json", is_flag=True)
def command(repeats: int, pings: int, bulk_mib: int, bulk_reps: int,
            rendezvous_rounds: int, allreduce_bytes: str, allreduce_iters: int, cycles: int,
            quick: bool, as_json: bool) -> None:
    """3 hosts x 1 rank on network namespaces vs one host: link, rendezvous, gloo.

    Needs root and iproute2 (``ip netns``); says why where namespaces cannot be made."""
    opts: dict[str, Any] = {
        "pings": pings, "bulk_mib": bulk_mib, "bulk_reps": bulk_reps,
        "rendezvous_rounds": rendezvous_rounds, "allreduce_iters": allreduce_iters,
        "cycles": cycles, "allreduce_bytes": [int(x) for x in allreduce_bytes.split(",")]}
    if quick:
        repeats = 1
        opts.update(pings=50, bulk_mib=1, bulk_reps=1, rendezvous_rounds=2,
                    allreduce_iters=20, cycles=3)
    swept = sweep_stale()
    if swept:
        click.echo(f"removed namespaces of killed earlier runs: {swept}", err=True)
    previous = {s: signal.signal(s, _unwind) for s in (signal.SIGTERM, signal.SIGHUP)}
    load_start = os.getloadavg()[0]
    started = time.monotonic()
    try:
        with hosts(NODES, die_with_parent=True) as nodes:
            figures = _measure(_Ctx(nodes, opts), repeats)
    except NetnsUnavailable as exc:
        raise click.ClickException(f"namespaces unavailable: {exc}") from exc
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    result: dict[str, Any] = {
        "layout": f"{NODES} hosts x 1 rank: network namespaces on one bridge (veth pairs)",
        "one_host": f"the same {NODES} processes in host 0's namespace, over loopback",
        "reported": "median over repeats of each run's median; gloo figures are rank 0's",
        "repeats": repeats, "options": opts,
        "load_avg_1m": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)},
        "wall_s": round(time.monotonic() - started, 1), **figures}
    emit(result, as_json)
