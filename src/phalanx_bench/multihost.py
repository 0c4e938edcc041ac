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
gloo ``new_group`` + ``barrier`` + ``destroy_process_group`` cycles (the same loop as
``bench domains``) on 3 hosts and on one; ``domain_cycle_across_hosts``: phalanx's
domain spanning the 3 hosts (allocated, one barrier, released) beside that gloo cycle
across them; ``layouts``: gloo's 4 KiB
all-reduce for 2 hosts x 2 ranks vs 4 ranks on one host beside the 3 x 1 one; and
``decode_tokens_per_s`` (:mod:`.multihost_serve`): ``phalanx serve`` across 3 hosts x 1
rank and 2 hosts x 2 ranks vs ``--tp 3`` / ``--tp 4`` on one host, decode and TTFT of one
streamed request. Every namespace shares this machine's cores, so the across-hosts side
carries CPU contention that separate machines would not. Figures of parts not built yet
are ``null`` with a ``<name>_reason``: each becomes a function in ``FIGURES`` when its
part exists (``group.part`` names report as ``result[group][part]``).

Nothing is left behind: the namespaces' teardown kills every process started in them,
the processes die with this one (``die_with_parent``), SIGTERM unwinds through the
teardown, and namespaces of an earlier run that was killed are swept first.
"""

from __future__ import annotations

import os
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

import click

from phalanx.serve.cli import INT_LIST

from ._stats import emit
from .multihost_launch import NODES, Ctx, NotBuilt, launch
from .multihost_serve import LAYOUTS, decode, decode_options
from .netns import NetnsUnavailable, hosts, sweep_stale

# -- the figures: each measures one side once ------------------------------------------


def _link(ctx: Ctx, side: str) -> dict[str, float]:
    """TCP between host 1 and host 0 over the veth pairs, or inside host 0's loopback."""
    o = ctx.opts
    port = next(ctx.ports)
    server_host, client_host = ctx.nodes[0], ctx.nodes[1] if side == "veth" else ctx.nodes[0]
    addr = server_host.addr if side == "veth" else "127.0.0.1"
    common = ["--port", str(port), "--pings", str(o["pings"]),
              "--bulk-bytes", str(o["bulk_mib"] << 20), "--bulk-reps", str(o["bulk_reps"])]
    _, client = launch(ctx, f"link ({side})",
                        [(server_host, ["tcp-server", "--bind", addr, *common]),
                         (client_host, ["tcp-client", "--addr", addr, *common])], "lo")
    return {"rtt_us_p50": client["rtt_us_p50"], "bulk_mb_s": client["bulk_mb_s"]}


def _rendezvous(ctx: Ctx, side: str) -> dict[str, float]:
    """``phalanx.hosts.rendezvous`` of 3 nodes: from node 0's store listening to the last
    node's return, per round (round 0 left out: the first connect of each process)."""
    rounds = ctx.opts["rendezvous_rounds"]
    nodes, master, ifname = ctx.layout(side)
    sync_port = next(ctx.ports)
    port = sync_port + 1  # rounds use port .. port + rounds - 1 (ports step by 50)
    lines = launch(ctx, f"rendezvous ({side})", [
        (h, ["rendezvous", "--nnodes", str(NODES), "--rank", str(r), "--master-addr", master,
             "--port", str(port), "--sync-port", str(sync_port), "--rounds", str(rounds)])
        for r, h in enumerate(nodes)], ifname)
    by_rank = {line["rank"]: line for line in lines}
    times = [max(by_rank[r]["ends"][k] for r in by_rank) - by_rank[0]["starts"][k]
             for k in range(rounds)]
    timed = times[1:] or times
    return {"ms_p50": statistics.median(timed) * 1e3}


def _gloo(ctx: Ctx, side: str, mode: str, extra: list[str],
          per_host: tuple[int, ...] = (1,) * NODES) -> dict[str, Any]:
    nodes, master, ifname = ctx.layout(side, per_host)
    port = next(ctx.ports)
    lines = launch(ctx, f"{mode} {'x'.join(map(str, per_host))} ({side})", [
        (h, [mode, "--world", str(len(nodes)), "--rank", str(r), "--master-addr", master,
             "--port", str(port), *extra]) for r, h in enumerate(nodes)], ifname)
    rank0: dict[str, Any] = next(line for line in lines if line["rank"] == 0)
    return rank0


def _allreduce(ctx: Ctx, side: str) -> dict[str, float]:
    """gloo all-reduce of float32 tensors across the 3 ranks: rank 0's median per size."""
    sizes: list[int] = ctx.opts["allreduce_bytes"]
    got = _gloo(ctx, side, "allreduce", ["--sizes", ",".join(map(str, sizes)),
                                         "--iters", str(ctx.opts["allreduce_iters"])])
    return {f"{_kib(s)}_us_p50": got[str(s)] for s in sizes}


def _allreduce_2x2(ctx: Ctx, side: str) -> dict[str, float]:
    """gloo all-reduce of 4 KiB over 4 ranks: 2 hosts x 2 ranks, or 4 ranks on one host
    (the layouts question: the 3 x 1 layout is ``allreduce_us``)."""
    got = _gloo(ctx, side, "allreduce", ["--sizes", str(_LAYOUT_BYTES), "--iters",
                                         str(ctx.opts["allreduce_iters"])], per_host=(2, 2))
    return {f"{_kib(_LAYOUT_BYTES)}_us_p50": got[str(_LAYOUT_BYTES)]}


def _group_cycle(ctx: Ctx, side: str) -> dict[str, float]:
    """gloo ``new_group`` + ``barrier(group)`` + ``destroy_process_group(group)``."""
    got = _gloo(ctx, side, "group-cycle", ["--cycles", str(ctx.opts["cycles"])])
    return {"us_p50": got["us_p50"]}


def _domain_cycle(ctx: Ctx, side: str) -> dict[str, float]:
    """A domain over the 3 hosts allocated, through one barrier, released: phalanx's
    (``MultiHostWorker.allocate_domain``, each step a round over the control plane) or
    gloo's ``new_group`` + ``barrier`` + ``destroy_process_group`` (the anchor)."""
    if side == "gloo":
        return _group_cycle(ctx, "hosts")
    port = next(ctx.ports)
    where = ["--nnodes", str(NODES), "--master-addr", ctx.nodes[0].addr, "--port", str(port)]
    # the agents are plain HostAgents: the replication figure's agent mode is one
    got, *_ = launch(ctx, "domain cycle (hosts)", [
        (ctx.nodes[0], ["domain-head", *where, "--cycles", str(ctx.opts["cycles"])]),
        *((h, ["replication-agent", *where, "--rank", str(r)])
          for r, h in enumerate(ctx.nodes) if r > 0)], "eth0")
    return {"us_p50": got["us_p50"]}


def _replication_template(ctx: Ctx) -> tuple[Path, int]:
    """The incident's directories (a chain of records, 7 of every 8 rows redundant),
    written once per run through the real replicated path; and a tenth of their size."""
    if "repl_template" not in ctx.made:
        from phalanx.replication import ReplicatedCache
        from phalanx.runtime import Worker

        from .multihost_rank import REPL_FINGERPRINT, repl_geometry

        tpl = ctx.workdir / "repl-template"
        with Worker(ranks=NODES) as w:
            cache = ReplicatedCache.open(w, tpl, geometry=repl_geometry(),
                                         fingerprint=REPL_FINGERPRINT, capacity_bytes=1 << 30)
            try:
                cache.synth(ctx.opts["repl_records"], "chain", group=8)
            finally:
                cache.close()
        size = sum(f.stat().st_size for f in (tpl / "rank-0").glob("*.kv"))
        ctx.made["repl_template"] = (tpl, max(1, size // 10))
    got: tuple[Path, int] = ctx.made["repl_template"]
    return got


def _replication_jobs_per_s(ctx: Ctx, side: str) -> dict[str, float]:
    """docs/architecture.md's recovered-chain burst (every record needs maintenance, capacity a
    tenth of the records): across the 3 hosts (each rank's shard on its host, the
    replication links over the veth pairs) or with the 3 ranks on one host."""
    import shutil

    tpl, capacity = _replication_template(ctx)
    cache = ctx.workdir / f"repl-{next(ctx.ports)}"
    shutil.copytree(tpl, cache, ignore=shutil.ignore_patterns(".lock"))
    common = ["--nnodes", str(NODES), "--cache", str(cache), "--capacity", str(capacity)]
    try:
        if side == "local":
            (got,) = launch(ctx, "replication (one host)",
                            [(ctx.nodes[0], ["replication-local", *common])], "lo")
        else:
            port = next(ctx.ports)
            where = ["--master-addr", ctx.nodes[0].addr, "--port", str(port)]
            got, *_ = launch(ctx, "replication (hosts)", [
                (ctx.nodes[0], ["replication-head", *common, *where]),
                *((h, ["replication-agent", *common, *where, "--rank", str(r)])
                  for r, h in enumerate(ctx.nodes) if r > 0)], "eth0")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return {"jobs_per_s": got["jobs_per_s"], "jobs": got["jobs"]}


_LAYOUT_BYTES = 4096
SHARED_MEMORY_REASON = (
    "not measured here: phalanx serve --nnodes keeps shared memory for a host's own ranks "
    "(HostTieredComm: they reduce over a domain of that host, only host sums cross over "
    "gloo), so decode_tokens_per_s's 2x2 runs on it, but its all-reduce alone is reached "
    "only through phalanx.engine.multihost.domains, no package's __all__, and the benchmarks "
    "use only phalanx's public API; the 2x2 figure here is flat gloo over all 4 ranks "
    "(docs/design.md measured the tiered path: 4 KiB 1.2-1.5 ms vs 3.0-3.5 ms gloo)")


@dataclass(frozen=True)
class _Figure:
    measure: Callable[[Ctx, str], dict[str, float]]
    sides: tuple[str, str]  # (measured, anchor): the ratio is measured / anchor


FIGURES: dict[str, _Figure] = {
    "link": _Figure(_link, ("veth", "loopback")),
    "rendezvous_ms": _Figure(_rendezvous, ("hosts", "one_host")),
    "allreduce_us": _Figure(_allreduce, ("hosts", "one_host")),
    "layouts.2x2": _Figure(_allreduce_2x2, ("hosts", "one_host")),
    "gloo_group_cycle_us": _Figure(_group_cycle, ("hosts", "one_host")),
    "domain_cycle_across_hosts": _Figure(_domain_cycle, ("phalanx", "gloo")),
    **{f"decode_tokens_per_s.{lay}": _Figure(partial(decode, layout=lay),
                                             ("hosts", "one_host")) for lay in LAYOUTS},
    "replication_jobs_per_s": _Figure(_replication_jobs_per_s, ("hosts", "local")),
}


# --quick checks shapes: one decode layout is enough (2 x 2 is the same code, another
# layout), and its two server starts are a minute of a loaded 2-core machine
_NOT_QUICK = {"decode_tokens_per_s.2x2"}


def _kib(n: int) -> str:
    return f"{n >> 10}KiB" if n % 1024 == 0 else f"{n}B"


def _round(x: float) -> float:
    """One decimal, or 3 significant digits below 10 (a gap of 0.04 ms is not 0.0)."""
    return round(x, 1) if abs(x) >= 10 else float(f"{x:.3g}")


def _summary(fig: _Figure, runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    a, b = fig.sides
    med = {side: {m: statistics.median(r[m] for r in runs[side]) for m in runs[side][0]}
           for side in fig.sides}
    ratios = {m: round(med[a][m] / med[b][m], 2) if med[b][m] else None for m in med[a]}
    return {a: {m: _round(v) for m, v in med[a].items()},
            b: {m: _round(v) for m, v in med[b].items()}, f"ratio_{a}_over_{b}": ratios}


def _measure(ctx: Ctx, repeats: int, figures: dict[str, _Figure]) -> dict[str, Any]:
    runs: dict[str, dict[str, list[dict[str, float]]]] = {}
    not_built: dict[str, str] = {}
    for rep in range(repeats):
        for name, fig in figures.items():
            if name in not_built:
                continue
            for side in fig.sides if rep % 2 == 0 else fig.sides[::-1]:
                try:
                    got = fig.measure(ctx, side)
                except NotBuilt as exc:
                    not_built[name] = str(exc)
                    break
                runs.setdefault(name, {}).setdefault(side, []).append(got)
    out: dict[str, Any] = {}
    for name, fig in figures.items():
        # "group.part" is reported as out[group][part]; a group is left out as a whole
        group, _, part = name.partition(".")
        if name in not_built:
            out[group], out[f"{group}_reason"] = None, not_built[name]
        elif part:
            out.setdefault(group, {})[part] = _summary(fig, runs[name])
        else:
            out[name] = _summary(fig, runs[name])
    return out


def _layouts(out: dict[str, Any]) -> None:
    """The 3 x 1 all-reduce beside the 2 x 2 one, and why no shared-memory subgroup."""
    if "layouts" not in out or "allreduce_us" not in out:
        return  # --only left them out
    key = f"{_kib(_LAYOUT_BYTES)}_us_p50"
    flat = out["allreduce_us"]
    if key in flat["hosts"]:
        out["layouts"]["3x1"] = {side: {key: part[key]} for side, part in flat.items()}
    out["layouts"]["shared_memory_subgroup"] = None
    out["layouts"]["shared_memory_subgroup_reason"] = SHARED_MEMORY_REASON


def _unwind(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # through the namespaces' teardown, not around it


@click.command("multihost")
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True)
@click.option("--pings", type=click.IntRange(1), default=2000, show_default=True,
              help="TCP ping-pongs per run.")
@click.option("--bulk-mib", type=click.IntRange(1), default=64, show_default=True)
@click.option("--bulk-reps", type=click.IntRange(1), default=3, show_default=True)
@click.option("--rendezvous-rounds", type=click.IntRange(1), default=6, show_default=True)
@click.option("--allreduce-bytes", default="4096,65536", show_default=True, type=INT_LIST)
@click.option("--allreduce-iters", type=click.IntRange(1), default=2000, show_default=True)
@click.option("--cycles", type=click.IntRange(1), default=100, show_default=True,
              help="group and domain cycles.")
@click.option("--decode-tokens", type=click.IntRange(1), default=128, show_default=True,
              help="tokens of each timed streamed request (greedy, ignore_eos).")
@click.option("--decode-requests", type=click.IntRange(1), default=3, show_default=True,
              help="timed requests per server start (after a warm-up request).")
@click.option("--decode/--no-decode", "with_decode", default=True, show_default=True,
              help="serve the model and time decode (4 server starts per repeat).")
@click.option("--quick", is_flag=True,
              help="Tiny counts and decode on 3x1 only: checks the shape, not a figure.")
@click.option("--only", multiple=True, metavar="FIGURE",
              type=click.Choice(sorted({n.partition(".")[0] for n in FIGURES})),
              help="measure only these figures (repeatable); default: all.")
@click.option("--json", "as_json", is_flag=True)
def command(repeats: int, pings: int, bulk_mib: int, bulk_reps: int,
            rendezvous_rounds: int, allreduce_bytes: list[int], allreduce_iters: int, cycles: int,
            decode_tokens: int, decode_requests: int, with_decode: bool, quick: bool,
            only: tuple[str, ...], as_json: bool) -> None:
    """3 hosts x 1 rank (and 2 x 2) on network namespaces vs one host: link, rendezvous,
    gloo, phalanx serve's decode.

    Needs root and iproute2 (``ip netns``); says why where namespaces cannot be made."""
    opts: dict[str, Any] = {
        "pings": pings, "bulk_mib": bulk_mib, "bulk_reps": bulk_reps,
        "rendezvous_rounds": rendezvous_rounds, "allreduce_iters": allreduce_iters,
        "cycles": cycles, "allreduce_bytes": allreduce_bytes,
        "repl_records": 1500}
    if quick:
        repeats = 1
        opts.update(pings=50, bulk_mib=1, bulk_reps=1, rendezvous_rounds=2,
                    allreduce_iters=20, cycles=3, repl_records=200)
        decode_tokens, decode_requests = 32, 1  # 8 came in one read at times: no rate
    opts.update(decode_options(with_decode, decode_tokens, decode_requests))
    swept = sweep_stale()
    if swept:
        click.echo(f"removed namespaces of killed earlier runs: {swept}", err=True)
    previous = {s: signal.signal(s, _unwind) for s in (signal.SIGTERM, signal.SIGHUP)}
    load_start = os.getloadavg()[0]
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="phx-multihost-") as work, \
                hosts(NODES, die_with_parent=True) as nodes:
            chosen = {n: f for n, f in FIGURES.items()
                      if (not only or n.partition(".")[0] in only)
                      and not (quick and n in _NOT_QUICK)}
            figures = _measure(Ctx(nodes, opts, Path(work)), repeats, chosen)
            _layouts(figures)
    except NetnsUnavailable as exc:
        raise click.ClickException(f"namespaces unavailable: {exc}") from exc
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    result: dict[str, Any] = {
        "layout": f"{NODES} hosts x 1 rank: network namespaces on one bridge (veth pairs); "
                  "layouts and decode_tokens_per_s also 2 hosts x 2 ranks",
        "one_host": "the same processes in host 0's namespace, over loopback; decode: "
                    "phalanx serve --tp 3 / --tp 4 there, no --nnodes",
        "machine": f"every namespace shares this machine's {os.cpu_count()} cores: the "
                   "across-hosts figures include the CPU contention of 3-4 ranks (and "
                   "their gloo threads) on them, which separate hosts would not have; "
                   "phalanx serve --nnodes gives each rank cores // ranks-on-its-host "
                   "threads (3x1: 3 ranks x 2 threads on 2 cores), one host cores // tp",
        "collectives": "decode across hosts: 3x1 gloo only; 2x2 a host's ranks over shared "
                       "memory, host sums over gloo (HostTieredComm); one host: phalanx's "
                       "shared-memory domain (DomainComm)",
        "decode": "phalanx serve of a 2-layer, hidden-192 model with 12 heads and 12 KV "
                  "heads (the embedded default has 8 heads, which TP 3 cannot split), disk "
                  "tier off (decode, not the cache); one greedy streamed request at a "
                  "time with ignore_eos after a warm-up; tokens_per_s from its first "
                  "token to its last, itl_ms_p50 the median gap between its tokens, "
                  "ttft_ms of its short prompt (14 tokens); one server start per side "
                  "and repeat",
        "reported": "median over repeats of each run's median; gloo figures are rank 0's",
        "repeats": repeats, "options": opts,
        "load_avg_1m": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)},
        "wall_s": round(time.monotonic() - started, 1), **figures}
    emit(result, as_json)
