"""Real hosts on one machine: network namespaces joined by veth pairs and a bridge.

``with hosts(3) as nodes:`` creates three namespaces, each a host with its own
address (10.77.0.1, .2, .3 on a /24), and a fourth namespace holding the bridge they all
plug into, so nothing is added to the root namespace (no bridge or veth of ours shows up
in the machine's own ``ip link``). Each veth pair has its host end (``eth0``) inside the
host's namespace and its bridge end (``v<i>``) in the bridge's; taking a bridge end down
cuts that host off from every other (``link_down``), a network partition.

Names carry this process's pid and a counter (``phx<pid>x<n>h<i>``), so a run that
crashed before its teardown cannot collide with this one, and :func:`sweep_stale` can
tell whose namespaces outlived their maker. Teardown runs in ``finally``, whatever the
body raised: every process started through ``run``/``popen`` is killed and reaped first,
then every namespace is deleted (its veth ends go with it), and every failure is
collected and raised together, never dropped.

Needs root and iproute2. Where namespaces cannot be created, :func:`hosts` raises
:class:`NetnsUnavailable` saying why (the tests' wrapper, tests/netns.py, turns it into a
skip; ``phalanx bench multihost`` into its error). No pytest here: the benchmark uses it.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from phalanx.lifecycle import PhalanxError

__all__ = ["SUBNET", "Host", "NetnsError", "NetnsUnavailable", "hosts",
           "namespaces_of_this_run", "skip_reason", "sweep_stale"]

SUBNET = "10.77.0"
_COUNTER = itertools.count()
_IP_TIMEOUT_S = 10.0  # one iproute2 command; they take milliseconds
_PR_SET_PDEATHSIG = 1


class NetnsError(PhalanxError):
    """An iproute2 command of the harness failed: the command and its stderr."""


class NetnsUnavailable(NetnsError):
    """Network namespaces cannot be made on this machine; the message says why."""


def _ip(*args: str) -> None:
    argv = ["ip", *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=_IP_TIMEOUT_S,
                          check=False)
    if done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")


def skip_reason() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's `ip`, which is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add`); this runs as uid " \
               f"{os.geteuid()}"
    return None


def _die_with_parent() -> None:
    """In the child between fork and exec: SIGKILL it when its parent dies, so a maker
    killed before its teardown (SIGKILL) leaves no process running in a namespace.
    ``ip netns exec`` execs the command, which keeps the setting (no set-uid exec)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclass
class Host:
    """One namespace: a host with its own address, and the processes started in it."""

    name: str
    addr: str
    index: int
    bridge_ns: str
    die_with_parent: bool = False  # see _die_with_parent; fork-unsafe with threads
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def _argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs: object) -> subprocess.Popen[bytes]:
        """Start ``argv`` in this host's namespace (``ip netns exec`` execs it, so the
        child's pid is the command's). Killed and reaped at teardown if still running."""
        if self.die_with_parent:
            kwargs.setdefault("preexec_fn", _die_with_parent)
        proc: subprocess.Popen[bytes] = subprocess.Popen(  # type: ignore[call-overload]
            self._argv(argv), env=dict(env) if env is not None else None, **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
            timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` here to completion; stdout and stderr captured as text."""
        proc = self.popen(argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(),
                                           err.decode())

    def link_down(self) -> None:
        """Cut this host off from every other host (its bridge port goes down)."""
        _ip("-n", self.bridge_ns, "link", "set", f"v{self.index}", "down")

    def link_up(self) -> None:
        _ip("-n", self.bridge_ns, "link", "set", f"v{self.index}", "up")

    def kill_all(self) -> list[str]:
        """Kill and reap every process started here; what failed, as text."""
        failures: list[str] = []
        for proc in self.procs:
            try:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=10)
                for stream in (proc.stdout, proc.stderr, proc.stdin):
                    if stream is not None:
                        stream.close()
            except (OSError, subprocess.TimeoutExpired) as exc:
                failures.append(f"{self.name}: pid {proc.pid}: {exc}")
        self.procs.clear()
        return failures


@contextlib.contextmanager
def hosts(n: int, die_with_parent: bool = False) -> Iterator[list[Host]]:
    """``n`` hosts on one bridge; everything removed on the way out (see module doc).

    Raises :class:`NetnsUnavailable` (before making anything) where namespaces cannot
    be made. ``die_with_parent``: processes started on the hosts get SIGKILL if this
    process dies (only for a caller with no other threads: it runs code after fork)."""
    reason = skip_reason()
    if reason is not None:
        raise NetnsUnavailable(reason)
    if not 1 <= n <= 200:
        raise ValueError(f"hosts(n): n must be 1-200, not {n}")
    prefix = f"phx{os.getpid()}x{next(_COUNTER)}"
    bridge_ns = f"{prefix}br"
    made: list[str] = []  # namespaces, in creation order: each is deleted at teardown
    nodes: list[Host] = []
    try:
        try:
            _ip("netns", "add", bridge_ns)
        except NetnsError as exc:
            raise NetnsUnavailable(f"cannot create a network namespace here: {exc}") from exc
        made.append(bridge_ns)
        _ip("-n", bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge_ns, "link", "set", "br0", "up")
        _ip("-n", bridge_ns, "link", "set", "lo", "up")
        for i in range(n):
            name = f"{prefix}h{i}"
            _ip("netns", "add", name)
            made.append(name)
            host = Host(name, f"{SUBNET}.{i + 1}", i, bridge_ns, die_with_parent)
            # both ends are born in the bridge's namespace; the host end moves at once
            _ip("-n", bridge_ns, "link", "add", f"v{i}", "type", "veth", "peer", "name",
                "eth0", "netns", name)
            _ip("-n", bridge_ns, "link", "set", f"v{i}", "master", "br0")
            _ip("-n", bridge_ns, "link", "set", f"v{i}", "up")
            _ip("-n", name, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
            nodes.append(host)
        yield nodes
    finally:
        failures: list[str] = []
        for host in nodes:
            failures += host.kill_all()
        for name in reversed(made):
            try:
                _ip("netns", "del", name)
            except (NetnsError, subprocess.TimeoutExpired) as exc:
                failures.append(str(exc))
        if failures:
            raise NetnsError("tearing the namespaces down failed:\n  " + "\n  ".join(failures))


def _list() -> list[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                          timeout=_IP_TIMEOUT_S, check=True)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def namespaces_of_this_run(pid: int | None = None) -> list[str]:
    """Namespaces whose name says process ``pid`` (default: this one) made them (what
    its teardown must remove)."""
    mine = f"phx{os.getpid() if pid is None else pid}x"
    return [name for name in _list() if name.startswith(mine)]


def _maker(name: str) -> int | None:
    """The pid in a harness namespace's name (``phx<pid>x...``), or None if not ours."""
    if not name.startswith("phx"):
        return None
    pid = name[3:].split("x", 1)[0]
    return int(pid) if pid.isdigit() and "x" in name[3:] else None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (comm's ``pid_alive`` is not in a package's ``__all__``, and
    the benchmarks use only phalanx's public API: tests/test_bench_public_api.py)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete the harness namespaces whose maker is dead (killed before its teardown),
    killing whatever still runs in them first; returns what it removed. Nothing else
    would ever remove them, and their addresses would shadow a new run's."""
    if skip_reason() is not None:
        return []
    removed = []
    for name in _list():
        pid = _maker(name)
        if pid is None or _alive(pid):
            continue
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True,
                              timeout=_IP_TIMEOUT_S, check=False).stdout.split()
        for p in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(p), signal.SIGKILL)
        with contextlib.suppress(NetnsError, subprocess.TimeoutExpired):
            _ip("netns", "del", name)
            removed.append(name)
    return removed
