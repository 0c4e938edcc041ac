"""What every figure of ``phalanx bench multihost`` shares: the run's context (its
namespaces, options, job token, ports and work directory) and :func:`launch`, which runs
one ``phalanx_bench.multihost_rank`` process per job in its host's namespace and returns
each one's JSON line (the first to fail is reported at once, naming host, mode and its
stderr). Its own module so that the figures' modules (:mod:`.multihost`,
:mod:`.multihost_serve`) can both use it without importing each other.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import selectors
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._errors import BenchError
from .netns import Host

NODES = 3  # namespaces made: 3 x 1 uses all three, 2 x 2 the first two
_LAUNCH_TIMEOUT_S = 180.0  # one launch: torch's import on 4 processes of a loaded VM
_RANK_MODULE = "phalanx_bench.multihost_rank"


class NotBuilt(Exception):
    """A figure that cannot be measured in this run (its part of phalanx does not exist
    yet, or ``--no-decode`` leaves it out): reported null with the reason."""


@dataclass
class Ctx:
    nodes: list[Host]
    opts: dict[str, Any]
    workdir: Path  # the run's model, runtime directories and server logs; removed after
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    ports: Iterator[int] = field(default_factory=lambda: itertools.count(29500, 50))
    made: dict[str, Any] = field(default_factory=dict)  # what a figure wrote once per run

    def layout(self, side: str, per_host: tuple[int, ...] = (1, 1, 1)
               ) -> tuple[list[Host], str, str]:
        """The host of each rank, node 0's address and gloo's interface for a side:
        ``per_host[i]`` ranks on host i across hosts, all of them in host 0 on one host."""
        if side == "hosts":
            return ([h for h, n in zip(self.nodes, per_host, strict=False) for _ in range(n)],
                    self.nodes[0].addr, "eth0")
        return [self.nodes[0]] * sum(per_host), "127.0.0.1", "lo"

    def env(self, ifname: str) -> dict[str, str]:
        return {**os.environ, "PHALANX_JOB_TOKEN": self.token, "TORCH_CPP_LOG_LEVEL": "ERROR",
                "GLOO_SOCKET_IFNAME": ifname, "OMP_NUM_THREADS": "1"}


def launch(ctx: Ctx, what: str, jobs: list[tuple[Host, list[str]]],
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
