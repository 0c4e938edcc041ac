"""``phalanx serve --nnodes N --node-rank R``: one server over the ranks of several hosts.

Node 0 runs the :class:`~phalanx.hosts.MultiHostWorker` (the rendezvous, the job's store,
its own ranks) and the HTTP server; every other node runs headless: its
:class:`~phalanx.hosts.HostAgent` starts its ranks and serves node 0 until the job ends.
The shape users know from vLLM, SGLang and torchrun; the job token (PHALANX_JOB_TOKEN,
the same on every host) authenticates the hosts to each other.

The disk tier spans the hosts: each host's ranks keep their shards under the same
``--prefix-cache-disk`` path on that host (engine/multihost/disk.py).

A lost host ends the job: node 0's engine fails what is in flight naming the node and
its ranks, ``/health`` turns 503, and every host exits 1 naming the lost node, so that
a supervisor restarts the job (the engine does not restart itself across hosts: the
lost host's ranks cannot be started from here).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, replace

from .server import ServerConfig, run_server

__all__ = ["JobSpec", "serve_job"]

log = logging.getLogger("phalanx.serve")


@dataclass(frozen=True)
class JobSpec:
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    timeout: float = 300.0  # for the rendezvous: hosts start minutes apart in practice
    lost_after: float = 5.0


def serve_job(cfg: ServerConfig, job: JobSpec) -> int:
    """Run this node's part of a multi-host ``serve``; the exit status."""
    from phalanx.engine import rank_env
    from phalanx.hosts import HostAgent, MultiHostWorker, NodeSpec

    token = os.environ.get("PHALANX_JOB_TOKEN", "")
    if not token:
        print("phalanx serve: a job of several hosts needs a job token: set "
              "PHALANX_JOB_TOKEN to the same secret on every host", file=sys.stderr)
        return 2
    tp = cfg.tensor_parallel_size
    if tp % job.nnodes:
        print(f"phalanx serve: --tp {tp} does not split over --nnodes {job.nnodes} (each "
              f"host runs tp / nnodes ranks)", file=sys.stderr)
        return 2
    per_node = tp // job.nnodes
    spec = NodeSpec(job.nnodes, job.node_rank, job.master_addr, job.master_port, token,
                    timeout=job.timeout)
    if job.node_rank != 0:
        try:
            ex = HostAgent(spec, per_node, lost_after=job.lost_after, env=rank_env()).run()
        except Exception as exc:  # noqa: BLE001  the command's one line
            print(f"phalanx serve (node {job.node_rank}): {exc}", file=sys.stderr, flush=True)
            return 1
        print(f"phalanx serve (node {job.node_rank}): {ex.reason}", file=sys.stderr,
              flush=True)
        return ex.code
    try:
        hosts = MultiHostWorker(spec, per_node, lost_after=job.lost_after, env=rank_env())
    except Exception as exc:  # noqa: BLE001  the command's one line
        print(f"phalanx serve (node 0): the job did not start: {exc}", file=sys.stderr,
              flush=True)
        return 1
    code = 1
    try:
        # no self-healing across hosts: a lost host exits the job (module docstring)
        code = run_server(replace(cfg, restart=False), hosts=hosts)
    finally:
        try:
            hosts.close()
        except Exception as exc:  # noqa: BLE001  reported; the exit says it failed
            print(f"phalanx serve (node 0): closing the job: {exc}", file=sys.stderr,
                  flush=True)
            code = code or 1
    if hosts.dead is not None:
        print(f"phalanx serve (node 0): the job failed: {hosts.dead}", file=sys.stderr,
              flush=True)
        code = code or 1
    return code
