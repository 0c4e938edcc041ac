"""``python -m phalanx.hosts.probe``: one node's rendezvous, as a JSON line.

    PHALANX_JOB_TOKEN=... python -m phalanx.hosts.probe --nnodes 3 --node-rank 1 \\
        --master-addr 10.77.0.1 --master-port 29400 [--timeout 60] [--addr A]

On success it prints ``{"ok": true, "node_rank": R, "nnodes": N, "master": "A:P",
"peers": [{"node_rank", "addr", "pid"}, ...], "store_keys_after": K, "rendezvous_s": S}``
(K: keys left in node 0's store, 0; null elsewhere; S: this node's time in
``rendezvous``, torch's import included) and exits 0. On failure it prints ``{"ok": false,
"error": TYPE, "message": TEXT, "missing": [...]}`` and exits 1 (2 for bad arguments).
No CLI framework: the tests run it in every namespace, and it must start fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from phalanx.rendezvous import HandshakeTimeoutError, RendezvousError

from .args import add_node_arguments
from .rendezvous import NodeSpec, rendezvous


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m phalanx.hosts.probe",
                                     description="Rendezvous one node; print a JSON line.")
    add_node_arguments(parser)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds (default 60)")
    parser.add_argument("--addr", default=None, help="address to advertise (default: the "
                        "local address facing the master)")
    args = parser.parse_args(argv)
    token = os.environ.get("PHALANX_JOB_TOKEN", "")
    try:
        spec = NodeSpec(args.nnodes, args.node_rank, args.master_addr, args.master_port,
                        token, args.addr, args.timeout)
    except ValueError as exc:
        print(json.dumps({"ok": False, "error": "ValueError", "message": str(exc),
                          "missing": []}), flush=True)
        return 2
    started = time.monotonic()
    try:
        membership = rendezvous(spec)
    except RendezvousError as exc:
        missing = exc.missing if isinstance(exc, HandshakeTimeoutError) else []
        print(json.dumps({"ok": False, "error": type(exc).__name__, "message": str(exc),
                          "missing": missing}), flush=True)
        return 1
    print(json.dumps({
        "ok": True, "node_rank": membership.node_rank, "nnodes": membership.nnodes,
        "master": membership.master,
        "peers": [{"node_rank": p.node_rank, "addr": p.addr, "pid": p.pid}
                  for p in membership.peers],
        "store_keys_after": membership.store_keys_after,
        "rendezvous_s": round(time.monotonic() - started, 4),  # torch imported inside
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
