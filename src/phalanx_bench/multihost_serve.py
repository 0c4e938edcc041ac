"""The decode figure of ``phalanx bench multihost``: ``phalanx serve`` across hosts vs the
same model served on one host.

Across hosts: ``phalanx serve MODEL --tp N --nnodes H --node-rank R --master-addr
10.77.0.1 ...`` in each of H namespaces (node 0 serves HTTP on its own address, the
others run headless; the job token and a runtime directory per host in the environment,
as tests/test_hosts_serve.py starts it). One host: ``phalanx serve MODEL --tp N`` in
host 0's namespace, no ``--nnodes``. The client is a ``multihost_rank decode-client``
process in host 0's namespace (this process cannot reach the namespaces' addresses):
a warm-up request, then greedy streamed requests with ``ignore_eos``, each timed from
its first token to its last (decode) and from its send to its first token (TTFT of its
short prompt). Every request's prompt differs, so none is a prefix-cache hit.

The model is the tests' (2 layers, hidden 192, 12 heads and 12 KV heads, so TP 3 and
TP 4 both split it): the embedded default model has 8 heads, which TP 3 cannot split.
The disk tier is off on both sides: this measures decode, not the cache.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ._errors import BenchError
from .multihost_launch import Ctx, NotBuilt, launch
from .netns import Host

LAYOUTS = {"3x1": (3, 1), "2x2": (2, 2)}  # hosts x ranks per host
_READY_S = 240.0  # torch's import and a model load on every rank of a loaded 2-core VM
_STOP_S = 60.0


def model_dir(ctx: Ctx) -> Path:
    """The tests' model, written once per run into the run's work directory by the
    public ``phalanx model init``."""
    target = ctx.workdir / "model"
    if not target.exists():
        done = subprocess.run([sys.executable, "-m", "phalanx.serve.cli._main", "model",
                               "init", str(target), "--layers", "2", "--hidden", "192",
                               "--heads", "12", "--kv-heads", "12", "--intermediate", "384",
                               "--name", "multihost-bench"], capture_output=True, text=True,
                              timeout=300, check=False)
        if done.returncode != 0:
            raise BenchError(f"phalanx model init {target} exited {done.returncode}: "
                             f"{done.stderr[-3000:]}")
    return target


class _Server:
    """One host's ``phalanx serve``: its own session (a last-resort SIGKILL reaches its
    ranks too) and its output in a log file (no pipe to drain, no reader thread: the
    namespaces' ``preexec_fn`` must not fork a threaded process)."""

    def __init__(self, host: Host, rank: int, argv: list[str], env: dict[str, str],
                 log: Path) -> None:
        self.host, self.rank, self.log = host, rank, log
        with log.open("wb") as out:
            self.proc = host.popen(argv, env, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)

    def tail(self, n: int = 3000) -> str:
        return self.log.read_bytes()[-n:].decode(errors="replace")

    def who(self) -> str:
        return f"phalanx serve node {self.rank} on {self.host.name} ({self.host.addr})"

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)


def _start(ctx: Ctx, layout: str, side: str, http: int, master_port: int) -> list[_Server]:
    nnodes, per_host = LAYOUTS[layout]
    tp = nnodes * per_host
    node0 = ctx.nodes[0]
    base = [sys.executable, "-m", "phalanx.serve.cli._main", "serve", str(model_dir(ctx)),
            "--tp", str(tp), "--host", node0.addr, "--port", str(http),
            "--kv-cache-size", "16M", "--no-prefix-cache-disk"]
    placed = ([(h, ["--nnodes", str(nnodes), "--node-rank", str(r), "--master-addr",
                    node0.addr, "--master-port", str(master_port)])
               for r, h in enumerate(ctx.nodes[:nnodes])] if side == "hosts"
              else [(node0, [])])
    servers = []
    try:
        for r, (host, extra) in enumerate(placed):
            run = ctx.workdir / f"{layout}-{side}-{master_port}-node{r}"
            run.mkdir(mode=0o700)
            env = {**os.environ, "PHALANX_JOB_TOKEN": ctx.token,
                   "TORCH_CPP_LOG_LEVEL": "ERROR", "TOKENIZERS_PARALLELISM": "false",
                   "PHALANX_RUNTIME_DIR": str(run / "runtime"),
                   "XDG_CACHE_HOME": str(run / "cache")}
            servers.append(_Server(host, r, base + extra, env, run / "serve.log"))
        return servers
    except BaseException:
        for s in servers:
            s.kill()
        raise


def _wait_ready(servers: list[_Server]) -> None:
    """Until node 0 says it is ready (every rank of every host up), or one exits."""
    deadline = time.monotonic() + _READY_S
    while "ready at" not in servers[0].log.read_text(errors="replace"):
        for s in servers:
            if s.proc.poll() is not None:
                raise BenchError(f"{s.who()} exited {s.proc.returncode} before the job was "
                                 f"ready:\n{s.tail()}")
        if time.monotonic() > deadline:
            raise BenchError(f"{servers[0].who()} not ready within {_READY_S:g}s:\n"
                             f"{servers[0].tail()}")
        time.sleep(0.1)


def _stop(servers: list[_Server]) -> None:
    """SIGTERM to node 0 (it closes the job on every host); each must exit 0."""
    servers[0].proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _STOP_S
    for s in servers:
        try:
            code = s.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise BenchError(f"{s.who()} still running {_STOP_S:g}s after node 0's SIGTERM:"
                             f"\n{s.tail()}") from None
        if code != 0:
            raise BenchError(f"{s.who()} exited {code} after SIGTERM:\n{s.tail()}")


def decode(ctx: Ctx, side: str, layout: str) -> dict[str, float]:
    """One server start of ``layout`` across hosts or on one host: the client's medians."""
    o = ctx.opts
    if not o["decode"]:
        raise NotBuilt(o["decode_skipped"])
    master_port = next(ctx.ports)
    http = master_port + 1
    servers = _start(ctx, layout, side, http, master_port)
    try:
        _wait_ready(servers)
        node0 = ctx.nodes[0]
        (got,) = launch(ctx, f"decode {layout} ({side})", [(node0, [
            "decode-client", "--url", f"http://{node0.addr}:{http}",
            "--max-tokens", str(o["decode_tokens"]), "--requests", str(o["decode_requests"]),
            "--warmup-tokens", str(o["decode_warmup_tokens"])])], "lo")
        _stop(servers)
    finally:
        for s in servers:
            if s.proc.poll() is None:
                s.kill()
    return {"tokens_per_s": got["tokens_per_s"], "itl_ms_p50": got["itl_ms_p50"],
            "ttft_ms": got["ttft_ms"]}


def decode_options(measure: bool, tokens: int, requests: int) -> dict[str, Any]:
    """The decode figure's options (``--no-decode`` leaves it out, with the reason)."""
    return {"decode": measure, "decode_tokens": tokens, "decode_requests": requests,
            "decode_warmup_tokens": min(16, tokens),
            "decode_skipped": "left out by --no-decode (4 phalanx serve jobs of 3-4 ranks "
                              "each take a minute or more to start on this machine)"}
