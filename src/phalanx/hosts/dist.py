"""torch.distributed across the job's hosts, from inside a rank.

A rank of a multi-host job joins a process group on the job's ``TCPStore`` (node 0 keeps
it open after the rendezvous) under a prefix of its own, so each group formed during the
job has keys of its own. gloo binds to the interface that holds this host's address in
the job (``PHALANX_NODE_ADDR``, set by the host's agent): left to itself it resolves the
machine's hostname, which on many hosts (and in every network namespace) names loopback
or another network than the job's.

Imports torch: call from rank tasks only.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from datetime import timedelta
from typing import Any

__all__ = ["destroy", "interface_of", "join_group"]

_SIOCGIFADDR = 0x8915


def interface_of(addr: str) -> str:
    """The name of this host's interface that holds IPv4 address ``addr``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                got = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(got[20:24]) == addr:
                return name
    raise OSError(f"no interface of this host holds {addr} (the address it has in the "
                  f"job): check --master-addr and the routes on this host")


def join_group(store_addr: str, store_port: int, prefix: str, rank: int, world: int,
               timeout: float, backend: str = "gloo", node_addr: str | None = None) -> Any:
    """``init_process_group`` of ``world`` ranks on the job's store; the default group.
    ``node_addr``: this host's address in the job (default ``PHALANX_NODE_ADDR``; an
    engine's local ranks give loopback).

    Raises naming this rank, its host and the store when the group does not form."""
    import torch.distributed as dist

    node_addr = node_addr or os.environ.get("PHALANX_NODE_ADDR")
    if node_addr and backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = interface_of(node_addr)
    where = f"rank {rank} of {world} on {node_addr or socket.gethostname()}"
    try:
        store = dist.TCPStore(store_addr, store_port, None, False,  # type: ignore[attr-defined]
                              timedelta(seconds=timeout), use_libuv=True)
        prefixed = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
        dist.init_process_group(backend, store=prefixed,
                                rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001  re-raised with who and where
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RuntimeError(f"{where}: the torch.distributed group {prefix!r} did not form on "
                           f"the store at {store_addr}:{store_port} within {timeout:g}s: "
                           f"{first}") from None
    return dist.group.WORLD


def destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
