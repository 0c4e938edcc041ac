"""``phalanx bench soak``: one ``phalanx serve`` under thousands of small mixed
requests, its memory and every rank's read as it goes (issue 45: one request never
takes the server down, and many never grow it).

A server that grows a little per request dies of it eventually, and a short benchmark
never shows it: here ``--requests`` (5,000) requests go to one server, ``--concurrency``
at a time, in the mix ``_soak_client`` describes (chat and completions, streamed or
not, 1-8 output tokens; 10% dropped by the client after the first chunk; 1% bad, which
must get a 4xx). Every ``--report-every`` finished requests the RSS (and PSS, from
``memory_full_info``) of the server and of each of its child processes (the ranks,
named by their ``PHALANX_RANK``) is read; at the end each process reports its value at
the first report (after warm-up: the first requests grow the heaps and caches to their
working size), its last, and its growth per 1,000 requests after warm-up, the
least-squares slope over the reports from the first on. Statuses are counted; a 5xx is
a bug (``status_5xx``), and so is a bad request answered with anything but a 4xx.

The server is the real command (the embedded model at ``--tp 2`` by default) on a free
port with a temporary ``--prefix-cache-disk``; it is stopped with SIGTERM and reaped,
its group killed past a deadline (``phalanx_bench.serve.ServerProc``), and the
temporary directories removed, whatever fails.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import click
import psutil

from phalanx.engine import default_model_dir

from ._errors import BenchError
from ._soak_client import Client, Outcome, Request, plan
from ._stats import emit
from .serve import servers, start_phalanx

__all__ = ["command", "slope_per_1k"]

_MB = 1 << 20


def slope_per_1k(points: list[tuple[int, float]]) -> float | None:
    """The least-squares slope of ``(requests, value)`` points, per 1,000 requests
    (None with fewer than two distinct request counts)."""
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    return sxy / sxx * 1000


class _Memory:
    """Reads the server's and its children's memory; names each process once."""

    def __init__(self, pid: int) -> None:
        self._server = psutil.Process(pid)
        self._names: dict[int, str] = {pid: "server"}
        self.identities: dict[str, tuple[int, float]] = {}  # name: (pid, create time)

    def _name(self, p: psutil.Process) -> str:
        name = self._names.get(p.pid)
        if name is None:
            try:
                rank = p.environ().get("PHALANX_RANK")
            except psutil.Error:
                rank = None
            base = f"rank {rank}" if rank is not None else p.name()
            # a rank restarted after a failure is another process: named apart
            name = base if base not in self._names.values() else f"{base} (pid {p.pid})"
            self._names[p.pid] = name
        if name not in self.identities:
            self.identities[name] = (p.pid, p.create_time())
        return name

    def sample(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for p in [self._server, *self._server.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):  # a process gone meanwhile
                name = self._name(p)
                try:
                    full = p.memory_full_info()
                    out[name] = {"rss_mb": round(full.rss / _MB, 2),
                                 "pss_mb": round(full.pss / _MB, 2)}
                except (psutil.AccessDenied, AttributeError):
                    out[name] = {"rss_mb": round(p.memory_info().rss / _MB, 2)}
        return out


class _Soak:
    """Sends the mix from ``concurrency`` threads and samples memory as requests finish."""

    def __init__(self, url: str, model: str, total: int, every: int, seed: int,
                 memory: _Memory) -> None:
        parsed = urllib.parse.urlsplit(url)
        self._host, self._port = parsed.hostname or "127.0.0.1", int(parsed.port or 80)
        self._model, self._total, self._every, self._seed = model, total, every, seed
        self._memory = memory
        self._lock = threading.Lock()
        self._sample_lock = threading.Lock()
        self._next = itertools.count()
        self.done = 0
        self.statuses: Counter[int] = Counter()
        self.kinds: Counter[str] = Counter()
        self.broken: Counter[str] = Counter()  # kind: replies that were not whole
        self.unexpected: list[dict[str, Any]] = []  # the first few surprises, for the log
        self.bad_not_4xx = 0
        self.reports: list[dict[str, Any]] = []
        self._t0 = time.perf_counter()

    def report(self, done: int) -> None:
        with self._sample_lock:
            self.reports.append({"requests": done,
                                 "elapsed_s": round(time.perf_counter() - self._t0, 2),
                                 "processes": self._memory.sample()})

    def run(self, concurrency: int) -> float:
        self._t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency, thread_name_prefix="soak") as pool:
            for f in [pool.submit(self._client_loop) for _ in range(concurrency)]:
                f.result()
        self.reports.sort(key=lambda r: int(r["requests"]))
        return time.perf_counter() - self._t0

    def _client_loop(self) -> None:
        client = Client(self._host, self._port)
        try:
            while True:
                with self._lock:
                    i = next(self._next)
                if i >= self._total:
                    return
                req = plan(i, self._model, self._seed)
                self._record(req, client.send(req))
        finally:
            client.close()

    def _record(self, req: Request, out: Outcome) -> None:
        surprise = (out.status != req.expected_status and not (req.bad and
                                                               400 <= out.status < 500))
        with self._lock:
            self.done += 1
            done = self.done
            self.statuses[out.status] += 1
            self.kinds[req.kind] += 1
            if req.bad and not 400 <= out.status < 500:
                self.bad_not_4xx += 1
            if not out.whole:
                self.broken[req.kind] += 1
            if (surprise or not out.whole) and len(self.unexpected) < 20:
                self.unexpected.append({"index": req.index, "kind": req.kind,
                                        "status": out.status, "error": out.error})
        if done % self._every == 0 or done == self._total:
            self.report(done)


def _per_process(reports: list[dict[str, Any]], identities: dict[str, tuple[int, float]]
                 ) -> dict[str, dict[str, Any]]:
    """First (after warm-up), last and growth per 1,000 requests of every process,
    over the reports after the start one; its pid and start time, to tell it gone."""
    after = [r for r in reports if r["requests"] > 0]
    names = sorted({n for r in after for n in r["processes"]}, key=lambda n: (n != "server", n))
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        seen = [(r["requests"], r["processes"][name]) for r in after if name in r["processes"]]
        pid, created = identities[name]
        row: dict[str, Any] = {"reports": len(seen), "pid": pid, "create_time": created}
        for key in ("rss_mb", "pss_mb"):
            pts = [(n, v[key]) for n, v in seen if key in v]
            if not pts:
                continue
            slope = slope_per_1k(pts)
            row[f"{key}_first"] = pts[0][1]
            row[f"{key}_last"] = pts[-1][1]
            row[f"{key}_per_1k"] = None if slope is None else round(slope, 3)
        out[name] = row
    return out


@contextlib.contextmanager
def _scratch(logs: str | None) -> Iterator[tuple[Path, Path, Path]]:
    """The temporary directory, the disk tier's directory in it and the log directory
    (in it too unless ``--logs`` keeps the logs)."""
    with tempfile.TemporaryDirectory(prefix="phx-bench-soak-") as tmp:
        where = Path(logs) if logs else Path(tmp) / "logs"
        where.mkdir(parents=True, exist_ok=True)
        yield Path(tmp), Path(tmp) / "disk", where


def run(model: Path, tp: int, total: int, concurrency: int, every: int, seed: int,
        logs: str | None, extra: list[str]) -> dict[str, Any]:
    with _scratch(logs) as (tmp, disk, where), servers() as started:
        s = start_phalanx(started, model, tp, disk, where / "phalanx-soak.log", extra)
        memory = _Memory(s.proc.pid)
        name = _served_name(s.url)
        soak = _Soak(s.url, name, total, every, seed, memory)
        soak.report(0)
        duration = soak.run(concurrency)
        alive = s.proc.poll() is None
        code = s.stop()
        started.remove(s)
        if not alive:
            raise BenchError(f"the server exited ({code}) during the soak:\n{s.tail()}")
    statuses = {str(k): v for k, v in sorted(soak.statuses.items())}
    return {
        "requests": soak.done, "duration_s": round(duration, 1),
        "requests_per_s": round(soak.done / duration, 1),
        "statuses": statuses,
        "status_5xx": sum(v for k, v in soak.statuses.items() if k >= 500),
        "no_response": soak.statuses.get(0, 0),
        "bad_not_4xx": soak.bad_not_4xx,
        "kinds": dict(sorted(soak.kinds.items())),
        "not_whole": dict(sorted(soak.broken.items())),
        "unexpected": soak.unexpected,
        "server_exit_code": code,
        "scratch": str(tmp),  # removed by now, with the disk tier in it
        "processes": _per_process(soak.reports, memory.identities),
        "reports": soak.reports,
    }


def _served_name(url: str) -> str:
    import json
    import urllib.request

    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return str(json.loads(r.read())["data"][0]["id"])


def _table(result: dict[str, Any]) -> None:
    procs = result["processes"]
    names = list(procs)
    click.echo("requests  " + "  ".join(f"{n + ' RSS MB':>16}" for n in names))
    for r in result["reports"]:
        cells = [r["processes"].get(n, {}).get("rss_mb") for n in names]
        click.echo(f"{r['requests']:>8}  " + "  ".join(
            f"{'-' if c is None else f'{c:.1f}':>16}" for c in cells))
    click.echo("per 1k    " + "  ".join(
        f"{'-' if procs[n].get('rss_mb_per_1k') is None else procs[n]['rss_mb_per_1k']:>16}"
        for n in names))
    click.echo(f"statuses {result['statuses']}  5xx {result['status_5xx']}  "
               f"bad not 4xx {result['bad_not_4xx']}  "
               f"{result['requests_per_s']} req/s")


@click.command("soak")
@click.option("--model", "model_dir", default=None, type=click.Path(exists=True),
              help="a model directory or GGUF file [default: the embedded model]")
@click.option("--tp", type=click.IntRange(1), default=2, show_default=True)
@click.option("--requests", "total", type=click.IntRange(1), default=5000,
              show_default=True)
@click.option("--concurrency", type=click.IntRange(1), default=4, show_default=True,
              help="client threads, each one request at a time")
@click.option("--report-every", "every", type=click.IntRange(1), default=1000,
              show_default=True, help="read every process's memory after this many "
                                      "finished requests")
@click.option("--seed", default=0, show_default=True)
@click.option("--server-arg", "extra", multiple=True,
              help="an extra argument for phalanx serve (repeatable)")
@click.option("--logs", default=None, type=click.Path(file_okay=False),
              help="keep the server's log here [default: a temporary directory]")
@click.option("--json", "as_json", is_flag=True)
def command(model_dir: str | None, tp: int, total: int, concurrency: int, every: int,
            seed: int, extra: tuple[str, ...], logs: str | None, as_json: bool) -> None:
    """Thousands of small mixed requests to one phalanx serve: RSS/PSS of the server
    and each rank every --report-every requests, growth per 1,000, statuses."""
    model = Path(model_dir) if model_dir else default_model_dir()
    load_start = round(os.getloadavg()[0], 2)
    result = run(model, tp, total, concurrency, every, seed, logs, list(extra))
    result["setup"] = {"model": str(model), "tp": tp, "requests": total,
                       "concurrency": concurrency, "report_every": every, "seed": seed,
                       "server_args": list(extra),
                       "cores": len(os.sched_getaffinity(0)),
                       "loadavg_1m_start": load_start,
                       "loadavg_1m_end": round(os.getloadavg()[0], 2)}
    if not as_json:
        _table(result)
    emit(result, True)
