"""Several hosts (issue 16): a job's nodes meet through node 0's c10d ``TCPStore``.

The layer above rendezvous and runtime that multi-host jobs start from. It holds the
rendezvous of nodes (:func:`rendezvous`, :mod:`phalanx.hosts.frames`), the multi-host
Worker of node 0 (:class:`MultiHostWorker`), the agent every other node runs
(:class:`HostAgent`, ``python -m phalanx.hosts.agent``) and the control plane between
them (:mod:`phalanx.hosts.control`), and domains spanning hosts
(:mod:`phalanx.hosts.domains`); docs/design.md, "Several hosts".
Importing it does not import torch.
"""

from .agent import AgentExit, HostAgent
from .domains import HostDomain, HostDomainView, view_of
from .frames import VERSION, JoinFrame, Peer, VerdictFrame
from .functions import function_name
from .rendezvous import Membership, NodeSpec, local_addr_towards, rendezvous
from .worker import HostLostError, MultiHostWorker, RemoteError

__all__ = [
    "VERSION",
    "AgentExit",
    "HostAgent",
    "HostDomain",
    "HostDomainView",
    "HostLostError",
    "JoinFrame",
    "Membership",
    "MultiHostWorker",
    "NodeSpec",
    "Peer",
    "RemoteError",
    "VerdictFrame",
    "function_name",
    "local_addr_towards",
    "rendezvous",
    "view_of",
]
