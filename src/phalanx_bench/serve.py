"""``phalanx bench serve``: ``phalanx serve`` beside ``transformers serve`` on the same
model directory, in the same run, driven by one streaming client that reports vLLM's
serving metrics (TTFT, inter-token latency p50/p99, request and output-token
throughput).

Servers (step 1's two at once, the rest one at a time), each bound to 127.0.0.1 on a
free port, every one stopped (SIGTERM, then SIGKILL of its process group after a
deadline) and reaped in a ``finally``, whatever fails:

1. Two phalanx servers at once, one with its disk tier on a fresh directory (cache
   enabled, cold), one with ``--no-prefix-cache-disk`` (serve has no switch for the
   memory tier, which is always on); a short request and ``--warmups`` untimed misses
   of ``--prompt-tokens`` warm each (a fresh rank's heap grows over its first misses,
   more with the disk tier on; docs/design.md says by how much; vLLM's client has
   ``--num-warmups`` for the same). (a) ``--pairs``
   completion prompts of ``--prompt-tokens`` each, every prompt cold on both servers
   back to back, in ABBA order: ``miss`` and the disk-off miss; ``miss_overhead`` =
   the median of the per-prompt ratios cache-enabled / disk-off TTFT, minus 1 (two
   servers minutes apart differ by more than the 5% this is to resolve on a shared
   machine; a pair is seconds apart). Then the first ``--reps`` again on the cache
   server: ``memory_hit``; then per rep a prompt whose first 95% is that rep's with a
   suffix of its own: ``memory_hit_95``, the shape of ``disk_hit_shared_95`` served
   from memory (its whole pages of the shared 95% cached, the rest computed: 128
   tokens against the memory hit's 64). ``disk_hit`` - ``memory_hit`` and
   ``disk_hit_shared_95`` - ``memory_hit_95`` are what the disk tier itself costs
   through the server. (b) ``--clients`` concurrent chat clients whose system
   prompts are shared (``--system-prompts`` of ``--system-tokens`` each, a distinct
   user turn per client), on the cache server, then other clients on the disk-off one:
   ``throughput_tps.cache`` / ``.no_cache`` (``throughput_overhead``: 1 - their ratio).
2. phalanx restarted on the cache server's directory: ``disk_hit``, the first
   ``--reps`` prompts again, now served from disk (``cached_tokens`` from
   ``usage.prompt_tokens_details``): whole pages, the last one computed, so 31 of a
   2,048-token prompt's 32 with 64-token pages (96.9%, the fewest whole pages that
   are at least the issue's 95%); then ``disk_hit_shared_95``, per rep a prompt whose
   first 95% of tokens is another missed prompt's (30 pages from disk, 93.75%, 128
   tokens computed: the shape of ``memory_hit_95``).
3. ``transformers serve MODEL --continuous-batching --device cpu`` (its paged,
   continuous-batching path, which runs on CPU in transformers 5; ``--transformers-mode
   static`` runs it without): a warm-up request (its first one compiles and captures
   for seconds), then the same miss and the same clients. Where it cannot start
   (missing ``fastapi``/``accelerate``: ``pip install 'transformers[serving]'``), the
   JSON's ``transformers.error`` says why and the rest still runs.

Each single-prompt request and each burst of clients starts once every phalanx
server's disk tier has stored what earlier requests left it (the server's
``phalanx:cache_disk_stores_pending`` gauge is 0), so no TTFT pays an earlier request's
background disk writes; then ``--settle-s`` of idle, every server alike (default 0: on
this VM idle is not free, see ``phalanx_bench.engine``). Prompts are text
(``transformers serve``'s completions take no token ids): seeded token ids of the
model's own tokenizer, decoded, so each is about ``--prompt-tokens`` tokens long
(``prompt_tokens`` reports what the server counted). Greedy, EOS ignored where the
server honours ``ignore_eos`` (phalanx does; transformers ignores the field).
TTFT is the first chunk carrying text; ITL the gaps between text chunks.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from phalanx.engine import default_model_dir

from ._errors import BenchError
from ._stats import emit, median, percentile

READY = re.compile(r"ready at (http://\S+)")
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 90.0


def _exe(name: str) -> str:
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise BenchError(f"no `{name}` executable beside this Python nor on PATH")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still running (zombies do not count: an
    orphan's parent may reap it late)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after ')'
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


class ServerProc:
    """One server process in its own session (so a last-resort SIGKILL reaches its whole
    group), its output in a log file; ``stop`` signals, waits, kills and reaps."""

    def __init__(self, name: str, cmd: list[str], log: Path) -> None:
        self.name = name
        self.log = log
        self._out = log.open("wb")
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True)
        self.url = ""

    def tail(self, n: int = 3000) -> str:
        return self.log.read_bytes()[-n:].decode(errors="replace")

    def wait_line(self, pattern: re.Pattern[str], timeout: float) -> re.Match[str]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            m = pattern.search(self.log.read_text(errors="replace"))
            if m:
                return m
            if self.proc.poll() is not None:
                raise BenchError(f"{self.name} exited with {self.proc.returncode} before it "
                                 f"was ready:\n{self.tail()}")
            time.sleep(0.1)
        raise BenchError(f"{self.name} not ready within {timeout:g}s:\n{self.tail()}")

    def wait_health(self, timeout: float) -> None:
        import httpx

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.name} exited with {self.proc.returncode} before it "
                                 f"was healthy:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            time.sleep(0.25)
        raise BenchError(f"{self.name} not healthy within {timeout:g}s:\n{self.tail()}")

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL of the process group past the deadline; always reaped.

        The group gets the deadline to empty on its own after the server exits: a
        helper may still be cleaning up after it (a multiprocessing resource tracker
        ignores SIGTERM and unlinks its parent's semaphores once the parent is gone).
        With the group killed at once, one suite run of three found seven
        ``/dev/shm/sem.mp-*`` left during the serve benchmark's test; not reproduced
        since, so this is the likely cause, not a proven one."""
        try:
            deadline = time.monotonic() + STOP_TIMEOUT_S
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    pass
            while _group_alive(self.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            # whatever of its group is left (ranks, workers) goes with it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            if self.proc.poll() is None:
                self.proc.wait(30)
            return self.proc.returncode
        finally:
            self._out.close()


@contextlib.contextmanager
def servers() -> Iterator[list[ServerProc]]:
    """Every server started inside is stopped and reaped on the way out, even on error."""
    started: list[ServerProc] = []
    try:
        yield started
    finally:
        for s in reversed(started):
            s.stop()


def start_phalanx(started: list[ServerProc], model: Path, tp: int, disk: Path | None,
                  log: Path, extra: list[str]) -> ServerProc:
    cmd = [_exe("phalanx"), "serve", str(model), "--tp", str(tp), "--host", "127.0.0.1",
           "--port", "0", *extra]
    cmd += ["--no-prefix-cache-disk"] if disk is None else ["--prefix-cache-disk", str(disk)]
    s = ServerProc("phalanx serve", cmd, log)
    started.append(s)
    s.url = s.wait_line(READY, START_TIMEOUT_S).group(1)
    return s


def start_transformers(started: list[ServerProc], model: Path, log: Path,
                       mode: str) -> ServerProc:
    port = _free_port()
    cmd = [_exe("transformers"), "serve", str(model), "--host", "127.0.0.1", "--port",
           str(port), "--device", "cpu", "--dtype", "float32",
           "--continuous-batching" if mode == "continuous" else "--no-continuous-batching"]
    s = ServerProc("transformers serve", cmd, log)
    started.append(s)
    s.url = f"http://127.0.0.1:{port}"
    s.wait_health(START_TIMEOUT_S)
    return s


def stop(started: list[ServerProc], s: ServerProc) -> None:
    s.stop()
    started.remove(s)


# -- the client -------------------------------------------------------------------------

@dataclass
class Timing:
    """One streamed request as the client saw it."""

    start: float
    ttft: float = 0.0
    end: float = 0.0
    chunks: list[float] = field(default_factory=list)   # arrival of each text chunk
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:], strict=False)]


# fields beyond the common ones, per server: transformers serve refuses unknown fields of
# a completion (422) and ignores stream_options (it always sends usage at the end)
PHALANX_EXTRA = {"stream_options": {"include_usage": True}, "ignore_eos": True}


def stream(client: Any, url: str, route: str, body: dict[str, Any]) -> Timing:
    """POST one streaming request; parse its server-sent events."""
    body = {**body, "stream": True, "temperature": 0.0}
    t = Timing(start=time.perf_counter())
    with client.stream("POST", url + route, json=body) as r:
        if r.status_code != 200:
            raise BenchError(f"{url}{route}: HTTP {r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            for choice in chunk.get("choices") or []:
                text = choice.get("text")
                if text is None:
                    text = (choice.get("delta") or {}).get("content")
                if text:
                    if not t.chunks:
                        t.ttft = now - t.start
                    t.chunks.append(now)
            usage = chunk.get("usage")
            if usage:
                t.output_tokens = int(usage.get("completion_tokens") or 0)
                t.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                details = usage.get("prompt_tokens_details") or {}
                t.cached_tokens = int(details.get("cached_tokens") or 0)
            timings = chunk.get("timings")   # llama.cpp's: cache_n prompt tokens reused
            if timings and not t.cached_tokens:
                t.cached_tokens = int(timings.get("cache_n") or 0)
    t.end = time.perf_counter()
    if not t.chunks:
        raise BenchError(f"{url}{route}: the stream carried no text")
    t.output_tokens = t.output_tokens or len(t.chunks)
    return t


def _client(n: int) -> Any:
    import httpx

    return httpx.Client(timeout=httpx.Timeout(600.0),
                        limits=httpx.Limits(max_connections=n + 4,
                                            max_keepalive_connections=n + 4))


# seconds of idle before each single-prompt request (--settle-s), on every server alike
SETTLE_S = [0.0]
# what a phalanx server reports its disk tier's stores queued or running in
_STORES_PENDING = re.compile(r"^phalanx:cache_disk_stores_pending (\S+)$", re.M)
_DRAIN_S = 120.0


def disk_writes_done(url: str) -> None:
    """Wait until the phalanx server at ``url`` has stored what earlier requests left its
    disk tier (at once without one)."""
    import httpx

    deadline = time.monotonic() + _DRAIN_S
    while True:
        m = _STORES_PENDING.search(httpx.get(url + "/metrics", timeout=30).text)
        if m is None:
            raise BenchError(f"{url}/metrics has no phalanx:cache_disk_stores_pending")
        if float(m.group(1)) == 0:
            return
        if time.monotonic() > deadline:
            raise BenchError(f"{url}: {m.group(1)} disk-tier stores still pending after "
                             f"{_DRAIN_S:g} s")
        time.sleep(0.01)


def one_prompt(url: str, model_name: str, prompt: str, max_tokens: int,
               extra: dict[str, Any], drain: tuple[str, ...] = ()) -> Timing:
    """One streamed completion, after the servers ``drain`` have no disk writes pending
    and ``--settle-s``."""
    for server in drain:
        disk_writes_done(server)
    time.sleep(SETTLE_S[0])
    with _client(1) as c:
        return stream(c, url, "/v1/completions", {"model": model_name, "prompt": prompt,
                                                  "max_tokens": max_tokens, **extra})


def concurrent_clients(url: str, model_name: str, chats: list[list[dict[str, str]]],
                       max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    """All ``chats`` at once, one thread each; vLLM's serving metrics over them."""
    barrier = threading.Barrier(len(chats))

    def one(messages: list[dict[str, str]]) -> Timing:
        barrier.wait(60)
        return stream(c, url, "/v1/chat/completions",
                      {"model": model_name, "messages": messages, "max_tokens": max_tokens,
                       **extra})

    with _client(len(chats)) as c, ThreadPoolExecutor(len(chats)) as pool:
        t0 = time.perf_counter()
        timings = list(pool.map(one, chats))
        duration = time.perf_counter() - t0
    return summarize(timings, duration)


def summarize(timings: list[Timing], duration: float) -> dict[str, Any]:
    ttft = [t.ttft * 1e3 for t in timings]
    itl = [x * 1e3 for t in timings for x in t.itl] or [0.0]
    out_tokens = sum(t.output_tokens for t in timings)
    return {
        "requests": len(timings), "duration_s": round(duration, 2),
        "ttft_ms_p50": round(percentile(ttft, 50), 1),
        "ttft_ms_p99": round(percentile(ttft, 99), 1),
        "itl_ms_p50": round(percentile(itl, 50), 2),
        "itl_ms_p99": round(percentile(itl, 99), 2),
        "request_throughput": round(len(timings) / duration, 3),
        "output_throughput_tps": round(out_tokens / duration, 1),
        "output_tokens": out_tokens,
        "cached_tokens": sum(t.cached_tokens for t in timings),
    }


def single(ts: list[Timing]) -> dict[str, Any]:
    """Medians over the repetitions of one single-request case (each its own prompt)."""
    itl = [x * 1e3 for t in ts for x in t.itl] or [0.0]
    return {"ttft_ms": round(median([t.ttft * 1e3 for t in ts]), 1),
            "ttft_ms_all": [round(t.ttft * 1e3, 1) for t in ts],
            "itl_ms_p50": round(median(itl), 2),
            "prompt_tokens": int(median([t.prompt_tokens for t in ts])),
            "cached_tokens": int(median([t.cached_tokens for t in ts])),
            "output_tokens": int(median([t.output_tokens for t in ts]))}


# -- prompts ----------------------------------------------------------------------------

class Prompts:
    """Seeded text prompts of about a given token count in the model's tokenizer (a
    Hugging Face directory's or a GGUF file's: phalanx's own reader of both)."""

    def __init__(self, model: Path) -> None:
        from phalanx.engine import Tokenizer

        self.tok = Tokenizer(model)
        self.vocab = self.tok.vocab_size

    def ids(self, seed: int, n: int) -> list[int]:
        import numpy as np

        # a text of n tokens: decode seeded ids, re-encode, keep n of them
        rng = np.random.default_rng(seed)
        text = self.tok.decode(rng.integers(8, self.vocab, n + n // 4 + 8).tolist())
        return self.tok.encode(text, add_special_tokens=False)[:n]

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def _chats(p: Prompts, clients: int, systems: int, system_tokens: int, seed: int
           ) -> list[list[dict[str, str]]]:
    system = [p.text(p.ids(seed + 1000 + i, system_tokens)) for i in range(systems)]
    return [[{"role": "system", "content": system[i % systems]},
             {"role": "user", "content": p.text(p.ids(seed + 2000 + i, 32))}]
            for i in range(clients)]


# -- the command ------------------------------------------------------------------------

def _served_name(url: str) -> str:
    import httpx

    models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    return str(models[0]["id"])


def paired_misses(cache_url: str, nocache_url: str, name: str, prompts: list[str],
                  max_tokens: int) -> tuple[list[Timing], list[Timing]]:
    """Each prompt cold on both servers, in ABBA order (cache first, then disk tier off
    first, ...), so a drift of the machine's load over the run falls on both alike."""
    cache: list[Timing] = []
    nocache: list[Timing] = []
    for i, q in enumerate(prompts):
        order = [(cache_url, cache), (nocache_url, nocache)]
        if i % 2:
            order.reverse()
        for url, into in order:
            into.append(one_prompt(url, name, q, max_tokens, PHALANX_EXTRA,
                                   (cache_url, nocache_url)))
    return cache, nocache


def run(model: Path, tp: int, prompt_tokens: int, reps: int, pairs: int, warmups: int,
        max_tokens: int, clients: int, systems: int, system_tokens: int, seed: int,
        transformers_mode: str, with_transformers: bool, logs: Path) -> dict[str, Any]:
    p = Prompts(model)
    shared = round(prompt_tokens * 0.95)
    # every first prompt is missed on both servers; the shared-95% disk hits extend
    # the ones after the first reps (whose pages the repeats load into memory)
    firsts = [p.ids(seed + 10 * i, prompt_tokens) for i in range(max(2 * reps, pairs))]
    prompts = [p.text(f) for f in firsts]
    prompts95 = [p.text(f[:shared] + p.ids(seed + 10 * i + 1, prompt_tokens - shared))
                 for i, f in enumerate(firsts[reps:2 * reps])]
    # the same shape with another suffix: the disk hits' pages 30+ stay uncached
    mem95 = [p.text(f[:shared] + p.ids(seed + 10 * i + 2, prompt_tokens - shared))
             for i, f in enumerate(firsts[:reps])]
    warm = p.text(p.ids(seed + 7, 64))
    chats = _chats(p, clients, systems, system_tokens, seed)
    chats_nc = _chats(p, clients, systems, system_tokens, seed + 50)   # cold for that one too
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="phx-bench-serve-") as tmp, servers() as started:
        disk = Path(tmp) / "disk"
        # both phalanx servers up at once (an idle one costs no core), so the cold misses
        # that give miss_overhead alternate between them instead of comparing two
        # servers minutes apart on a machine whose load drifts more than 5%
        s = start_phalanx(started, model, tp, disk, logs / "phalanx-cache.log", [])
        nc = start_phalanx(started, model, tp, None, logs / "phalanx-nocache.log", [])
        name = _served_name(s.url)
        one_prompt(s.url, name, warm, 4, PHALANX_EXTRA)
        one_prompt(nc.url, name, warm, 4, PHALANX_EXTRA)
        paired_misses(s.url, nc.url, name, [p.text(p.ids(seed + 5000 + i, prompt_tokens))
                                            for i in range(warmups)], 4)
        miss, miss_nc = paired_misses(s.url, nc.url, name, prompts, max_tokens)
        both = (s.url, nc.url)
        mem = [one_prompt(s.url, name, q, max_tokens, PHALANX_EXTRA, both)
               for q in prompts[:reps]]
        mem_95 = [one_prompt(s.url, name, q, max_tokens, PHALANX_EXTRA, both) for q in mem95]
        disk_writes_done(s.url)
        burst = concurrent_clients(s.url, name, chats, max_tokens, PHALANX_EXTRA)
        disk_writes_done(s.url)   # the burst's stores would share the cores with the next
        burst_nc = concurrent_clients(nc.url, name, chats_nc, max_tokens, PHALANX_EXTRA)
        stop(started, nc)
        stop(started, s)
        s = start_phalanx(started, model, tp, disk, logs / "phalanx-restart.log", [])
        one_prompt(s.url, name, warm + " restart", 4, PHALANX_EXTRA)
        disk_hit = [one_prompt(s.url, name, q, max_tokens, PHALANX_EXTRA, (s.url,))
                    for q in prompts[:reps]]
        disk_95 = [one_prompt(s.url, name, q, max_tokens, PHALANX_EXTRA, (s.url,))
                   for q in prompts95]
        stop(started, s)
        ratios = [a.ttft / b.ttft for a, b in zip(miss, miss_nc, strict=True)]
        out["phalanx"] = {"miss": single(miss), "memory_hit": single(mem),
                          "memory_hit_95": single(mem_95),
                          "disk_hit": single(disk_hit),
                          "disk_hit_shared_95": single(disk_95), "clients": burst,
                          "no_cache": {"miss": single(miss_nc), "clients": burst_nc},
                          "miss_pair_ratios": [round(r, 3) for r in ratios]}
        if not all(t.cached_tokens for t in disk_hit + disk_95):
            raise BenchError("a disk hit after the restart reported no cached tokens")
        if with_transformers:
            try:
                t = start_transformers(started, model, logs / "transformers.log",
                                       transformers_mode)
            except BenchError as exc:
                why = _why_transformers(str(exc))
                out["transformers"] = {"error": why}
            else:
                tname = _served_name(t.url)
                t0 = time.perf_counter()
                one_prompt(t.url, tname, warm, 4, {})
                warm_s = time.perf_counter() - t0
                tmiss = [one_prompt(t.url, tname, q, max_tokens, {}) for q in prompts[:reps]]
                tburst = concurrent_clients(t.url, tname, chats, max_tokens, {})
                stop(started, t)
                out["transformers"] = {"mode": transformers_mode, "warmup_s": round(warm_s, 1),
                                       "miss": single(tmiss), "clients": tburst}
        else:
            out["transformers"] = {"error": "skipped (--no-transformers)"}
    return out


def _why_transformers(message: str) -> str:
    for needle, why in (("fastapi", "transformers serve needs fastapi (transformers[serving])"),
                        ("accelerate", "transformers serve needs accelerate on CPU "
                                       "(transformers[serving])")):
        if needle in message.lower():
            return f"{why}: {message.strip().splitlines()[-1][:300]}"
    return message.strip()[-600:]


def _shape(raw: dict[str, Any], prompt_tokens: int) -> dict[str, Any]:
    ph = raw["phalanx"]
    tr = raw["transformers"]
    miss = ph["miss"]["ttft_ms"]
    tput, tput_nc = (ph["clients"]["output_throughput_tps"],
                     ph["no_cache"]["clients"]["output_throughput_tps"])
    result: dict[str, Any] = {
        "ttft_ms": {"miss": miss, "memory_hit": ph["memory_hit"]["ttft_ms"],
                    "disk_hit": ph["disk_hit"]["ttft_ms"]},
        # the disk hit's shape from memory (the three cases stay in ttft_ms)
        "ttft_ms_memory_hit_95": ph["memory_hit_95"]["ttft_ms"],
        "ttft_ms_disk_hit_shared_95": ph["disk_hit_shared_95"]["ttft_ms"],
        "itl_ms_p50": ph["clients"]["itl_ms_p50"],
        "throughput_tps": {"cache": tput, "no_cache": tput_nc},
        # the median of the per-pair ratios: each pair ran the same prompt back to back
        "miss_overhead": round(median(ph["miss_pair_ratios"]) - 1, 4),
        "throughput_overhead": round(1 - tput / tput_nc, 4),
        "disk_cached_fraction": round(ph["disk_hit"]["cached_tokens"]
                                      / max(1, ph["disk_hit"]["prompt_tokens"]), 4),
        "disk_cached_fraction_shared_95": round(
            ph["disk_hit_shared_95"]["cached_tokens"]
            / max(1, ph["disk_hit_shared_95"]["prompt_tokens"]), 4),
        "phalanx": ph,
    }
    if "error" in tr:
        result["transformers"] = {"ttft_ms_miss": None, "itl_ms_p50": None,
                                  "throughput_tps": None, "error": tr["error"]}
    else:
        result["transformers"] = {"ttft_ms_miss": tr["miss"]["ttft_ms"],
                                  "itl_ms_p50": tr["clients"]["itl_ms_p50"],
                                  "throughput_tps": tr["clients"]["output_throughput_tps"],
                                  **tr}
    t = result["transformers"]
    result["ratios"] = {
        "disk_hit_vs_miss": round(miss / ph["disk_hit"]["ttft_ms"], 2),
        "memory_hit_vs_miss": round(miss / ph["memory_hit"]["ttft_ms"], 2),
        "memory_hit_95_vs_miss": round(miss / ph["memory_hit_95"]["ttft_ms"], 2),
        "disk_hit_shared_95_vs_miss": round(miss / ph["disk_hit_shared_95"]["ttft_ms"], 2),
        "miss_vs_transformers": (round(t["ttft_ms_miss"] / miss, 2)
                                 if t["ttft_ms_miss"] else None),
        "throughput_vs_transformers": (round(tput / t["throughput_tps"], 2)
                                       if t["throughput_tps"] else None),
    }
    r = result["ratios"]
    result["goals"] = {
        "disk_hit_10x": r["disk_hit_vs_miss"] >= 10,
        "miss_no_slower_than_transformers": (None if r["miss_vs_transformers"] is None
                                             else r["miss_vs_transformers"] >= 1),
        "throughput_2x_transformers": (None if r["throughput_vs_transformers"] is None
                                       else r["throughput_vs_transformers"] >= 2),
        "miss_overhead_under_5pct": result["miss_overhead"] < 0.05,
    }
    return result


@click.command("serve")
@click.option("--model", "model_dir", default=None, type=click.Path(file_okay=False),
              help="a Hugging Face model directory [default: the embedded model]")
@click.option("--tp", type=click.IntRange(1), default=2, show_default=True)
@click.option("--prompt-tokens", type=click.IntRange(1), default=2048, show_default=True)
@click.option("--reps", type=click.IntRange(1), default=3, show_default=True,
              help="single-prompt cases: each this many times, a prompt of its own each")
@click.option("--pairs", type=click.IntRange(1), default=8, show_default=True,
              help="cold misses for miss_overhead: this many prompts, each on the cache-"
                   "enabled and the disk-off server in turn (ABBA order)")
@click.option("--warmups", type=click.IntRange(1), default=8, show_default=True,
              help="untimed misses on each phalanx server before the pairs")
@click.option("--max-tokens", type=click.IntRange(1), default=64, show_default=True,
              help="output tokens per request")
@click.option("--clients", type=click.IntRange(1), default=16, show_default=True)
@click.option("--system-prompts", "systems", type=click.IntRange(1), default=4, show_default=True)
@click.option("--system-tokens", type=click.IntRange(1), default=512, show_default=True)
@click.option("--transformers-mode", type=click.Choice(["continuous", "static"]),
              default="continuous", show_default=True)
@click.option("--no-transformers", is_flag=True, help="phalanx only")
@click.option("--settle-s", type=click.FloatRange(0), default=0.0, show_default=True,
              help="idle seconds before each single-prompt request, on every server "
                   "(after phalanx's background disk writes are done)")
@click.option("--logs", default=None, type=click.Path(file_okay=False),
              help="keep the servers' logs here [default: a temporary directory]")
@click.option("--seed", default=0, show_default=True)
@click.option("--quick", is_flag=True,
              help="tiny sizes (a smoke test): 256-token prompt, 4 clients, 8 tokens")
@click.option("--json", "as_json", is_flag=True)
def command(model_dir: str | None, tp: int, prompt_tokens: int, reps: int, pairs: int,
            warmups: int, max_tokens: int,
            clients: int,
            systems: int, system_tokens: int, transformers_mode: str, no_transformers: bool,
            settle_s: float, logs: str | None, seed: int, quick: bool, as_json: bool) -> None:
    """phalanx serve beside transformers serve: TTFT (miss, memory hit, disk hit after a
    restart), ITL and throughput of concurrent clients with shared system prompts."""
    if quick:
        prompt_tokens, max_tokens, clients, systems, system_tokens = 256, 8, 4, 2, 64
        reps, pairs, warmups = 1, 2, 0
    model = Path(model_dir) if model_dir else default_model_dir()
    SETTLE_S[0] = 0.0 if quick else settle_s
    with tempfile.TemporaryDirectory(prefix="phx-bench-serve-logs-") as tmp_logs:
        where = Path(logs) if logs else Path(tmp_logs)
        where.mkdir(parents=True, exist_ok=True)
        raw = run(model, tp, prompt_tokens, reps, pairs, warmups, max_tokens, clients, systems,
                  system_tokens, seed, transformers_mode, not no_transformers, where)
    result = _shape(raw, prompt_tokens)
    result["setup"] = {"model": str(model), "tp": tp, "prompt_tokens": prompt_tokens,
                       "reps": reps, "pairs": pairs, "warmups": warmups,
                       "settle_s": SETTLE_S[0],
                       "max_tokens": max_tokens, "clients": clients,
                       "system_prompts": systems, "system_tokens": system_tokens,
                       "cores": len(os.sched_getaffinity(0)),
                       "loadavg_1m": round(os.getloadavg()[0], 2), "quick": quick}
    emit(result, as_json)
