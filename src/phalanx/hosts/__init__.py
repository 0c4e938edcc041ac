"""Several hosts (issue 16): a job's nodes meet through node 0's c10d ``TCPStore``.

The layer above rendezvous and runtime that multi-host jobs start from. Today it holds
the rendezvous of nodes (:func:`rendezvous`, :mod:`phalanx.hosts.frames`) and the probe
the tests run in network namespaces (``python -m phalanx.hosts.probe``); the per-host
agent and the multi-host Worker come next (docs/design.md, "Several hosts").
Importing it does not import torch.
"""

from .frames import VERSION, JoinFrame, Peer, VerdictFrame
from .rendezvous import Membership, NodeSpec, local_addr_towards, rendezvous

__all__ = [
    "VERSION",
    "JoinFrame",
    "Membership",
    "NodeSpec",
    "Peer",
    "VerdictFrame",
    "local_addr_towards",
    "rendezvous",
]
