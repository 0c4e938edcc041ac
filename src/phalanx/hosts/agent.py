"""The per-host agent: one node's ranks in a multi-host job, run headless.

Every node but node 0 runs a :class:`HostAgent` (``phalanx serve --node-rank R`` or
``python -m phalanx.hosts.agent``). It meets the job in the rendezvous, starts, supervises
and reaps this host's ranks (a local :class:`~phalanx.Worker`, with its own runtime
directory), connects to node 0's control port and runs what node 0 sends, until node 0
stops the job. It never outlives the job: node 0 gone (its connection closed, or silent
past ``lost_after``) stops this host's ranks and :meth:`HostAgent.run` returns 1 naming
node 0; a stop for a failed job returns 1 naming what failed; a clean stop returns 0.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

from .args import add_node_arguments
from .control import (
    VERSION,
    Beat,
    Call,
    Challenge,
    Channel,
    ChannelClosedError,
    Hello,
    Reply,
    Stop,
    Stopped,
    Welcome,
    hello_proof,
    proofs_match,
    welcome_proof,
)
from .local import LocalRanks
from .rendezvous import NodeSpec, local_addr_towards, rendezvous

__all__ = ["AgentExit", "HostAgent"]

log = logging.getLogger("phalanx.hosts")

_FAILED_GRACE_S = 5.0  # as node 0's (worker.py)


@dataclass(frozen=True)
class AgentExit:
    """How the agent's job ended: ``code`` 0 (node 0 closed it) or 1, and why."""

    code: int
    reason: str


class HostAgent:
    """Node ``spec.node_rank`` (not 0) of a multi-host job; see the module docstring."""

    def __init__(self, spec: NodeSpec, ranks_per_node: int, *, start_timeout: float = 120.0,
                 task_timeout: float = 600.0, close_timeout: float = 30.0,
                 heartbeat: float = 0.5, lost_after: float = 5.0,
                 runtime_dir: str | None = None, env: dict[str, str] | None = None) -> None:
        if spec.node_rank == 0:
            raise ValueError("node 0 runs the MultiHostWorker, not an agent")
        self.spec, self.ranks_per_node = spec, ranks_per_node
        self._timeouts = (start_timeout, task_timeout, close_timeout)
        self._heartbeat, self._lost_after = heartbeat, lost_after
        self._runtime_dir, self._env = runtime_dir, env
        self.addr = spec.addr or local_addr_towards(spec.master_addr, spec.master_port)
        self.me = f"node {spec.node_rank} ({self.addr})"
        self._ending: AgentExit | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._reported: set[int] = set()

    def run(self) -> AgentExit:
        """Meet, start the ranks, serve node 0 until the job ends; always reaps them."""
        start_timeout, task_timeout, close_timeout = self._timeouts
        membership = rendezvous(self.spec)
        head = membership.peers[0]
        local = LocalRanks(self.ranks_per_node, self.spec.node_rank,
                           runtime_dir=self._runtime_dir, env=self._env,
                           start_timeout=start_timeout, task_timeout=task_timeout,
                           close_timeout=close_timeout, node_addr=self.addr,
                           token=self.spec.token)
        channel: Channel | None = None
        try:
            channel = self._connect(head.addr, head.port, local, start_timeout)
            watch = threading.Thread(target=self._watch, args=(channel, local),
                                     name="phalanx-agent-watch", daemon=True)
            self._last_seen = time.monotonic()
            watch.start()
            self._serve(channel, local)
            watch.join(self._heartbeat * 4 + 5)
        finally:
            errors = ""
            failed = self._ending is None or self._ending.code != 0
            try:  # a failed job's tasks wait on lost ranks: a short grace, then killed
                local.close(min(close_timeout, _FAILED_GRACE_S) if failed else None)
            except Exception as exc:  # noqa: BLE001  told to node 0, and in the exit
                errors = f"{self.me}: closing its ranks: {exc}"
            if channel is not None:
                try:
                    channel.send(Stopped(errors))
                except ChannelClosedError:
                    pass  # node 0 is gone: nobody to tell
                channel.close()
        ex = self._ending or AgentExit(1, f"{self.me}: stopped without a reason")
        if errors:
            ex = AgentExit(1, f"{ex.reason}; {errors}")
        return ex

    def _connect(self, addr: str, port: int, local: LocalRanks, timeout: float) -> Channel:
        where = f"node 0's control port {addr}:{port}"
        try:
            sock = socket.create_connection((addr, port), timeout=min(timeout, 30.0))
        except OSError as exc:
            raise ConnectionError(f"{self.me}: cannot reach {where}: {exc}") from exc
        channel = Channel(sock, f"node 0 ({addr}:{port})")
        try:
            challenge = channel.recv(timeout=30.0)
            if not isinstance(challenge, Challenge) or challenge.version != VERSION:
                raise ConnectionError(f"{self.me}: {where} did not speak phalanx's control "
                                      f"protocol version {VERSION}")
            hello = Hello(VERSION, self.spec.node_rank, os.getpid(), local.global_ranks())
            hello = Hello(hello.version, hello.node_rank, hello.pid, hello.ranks,
                          hello_proof(self.spec.token, challenge.nonce, hello))
            channel.send(hello)
            answer = channel.recv(timeout=30.0)
        except (OSError, ChannelClosedError) as exc:
            channel.close()
            raise ConnectionError(f"{self.me}: the handshake with {where} failed: {exc}"
                                  ) from exc
        if isinstance(answer, Stop):
            channel.close()
            raise ConnectionError(f"{self.me}: refused by node 0: {answer.reason}")
        if not (isinstance(answer, Welcome) and proofs_match(
                answer.proof, welcome_proof(self.spec.token, challenge.nonce, hello))):
            channel.close()
            raise ConnectionError(f"{self.me}: {where} does not prove this job's token: "
                                  f"another job there?")
        return channel

    def _serve(self, channel: Channel, local: LocalRanks) -> None:
        while not self._done.is_set():
            try:
                frame = channel.recv()
            except (ChannelClosedError, OSError) as exc:
                self._end(1, f"{self.me}: node 0 ({channel.peer}) lost: {exc}; stopping "
                             f"this host's ranks")
                return
            self._last_seen = time.monotonic()
            if isinstance(frame, Call):
                local.pool().submit(self._call, channel, local, frame)
            elif isinstance(frame, Stop):
                self._end(1 if frame.failed else 0, f"{self.me}: {frame.reason}")
                return

    def _call(self, channel: Channel, local: LocalRanks, call: Call) -> None:
        try:
            value = (local.execute_host(call.fn, call.args) if call.host
                     else local.execute(call.rank, call.fn, call.args, call.timeout))
            reply = Reply(call.id, True, value)
        except BaseException as exc:  # noqa: BLE001  every failure goes back to node 0
            reply = Reply(call.id, False, error=type(exc).__name__,
                          message=f"rank {call.rank} on {self.me}: {type(exc).__name__}: "
                                  f"{exc}",
                          exitcode=getattr(exc, "exitcode", None), rank=call.rank)
        try:
            channel.send(reply)
        except ChannelClosedError:
            pass  # node 0 gone: the serve loop ends the job

    def _watch(self, channel: Channel, local: LocalRanks) -> None:
        while not self._done.wait(self._heartbeat):
            silent = time.monotonic() - self._last_seen
            if silent > self._lost_after:
                self._end(1, f"{self.me}: node 0 ({channel.peer}) lost: silent for "
                             f"{silent:.1f}s (over {self._lost_after:g}s); stopping this "
                             f"host's ranks")
                channel.close()  # wakes the serve loop
                return
            lost = sorted(local.lost() - self._reported)
            self._reported.update(lost)
            try:
                channel.send(Beat(lost, [f"rank {r} exited" for r in lost]))
            except ChannelClosedError:
                pass  # the serve loop sees it too

    def _end(self, code: int, reason: str) -> None:
        with self._lock:
            if self._ending is None:
                self._ending = AgentExit(code, reason)
        self._done.set()


def main(argv: list[str] | None = None) -> int:
    """``python -m phalanx.hosts.agent``: run one node's agent (token: PHALANX_JOB_TOKEN)."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m phalanx.hosts.agent",
                                description="Run node R's ranks of a multi-host job.")
    add_node_arguments(p)
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60.0, help="rendezvous seconds")
    p.add_argument("--lost-after", type=float, default=5.0,
                   help="seconds of silence after which node 0 counts as lost")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    try:
        spec = NodeSpec(args.nnodes, args.node_rank, args.master_addr, args.master_port,
                        os.environ.get("PHALANX_JOB_TOKEN", ""), timeout=args.timeout)
        ex = HostAgent(spec, args.ranks_per_node, lost_after=args.lost_after).run()
    except Exception as exc:  # noqa: BLE001  the CLI's one line
        print(f"phalanx agent: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"phalanx agent: {ex.reason}", file=sys.stderr, flush=True)
    return ex.code


if __name__ == "__main__":
    raise SystemExit(main())
