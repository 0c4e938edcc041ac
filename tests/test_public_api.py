"""The public surface is declared and pinned: a change here is an API change.

Each package's ``__all__`` is listed below, sorted. Adding or removing a public name
means editing this file too, on purpose. ``phalanx.errors`` must hold every exception
class that any layer's ``_errors.py`` defines, and its docstring must draw the real tree.
"""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import phalanx
import phalanx.errors
from phalanx.lifecycle import PhalanxError

SRC = Path(phalanx.__file__).parent

PUBLIC: dict[str, list[str]] = {
    "phalanx": [
        "Domain", "DomainView", "LLM", "Orchestrator", "RunHandle", "SamplingParams",
        "TaskFuture", "Worker", "WorkerStats", "__version__", "current_rank",
    ],
    "phalanx.lifecycle": [
        "CleanupError", "CleanupJournal", "Failpoint", "FailpointError", "PhalanxError",
        "ResourceError", "ResourceReleasedError", "ResourceUncertainError",
    ],
    "phalanx.lifecycle.failpoints": [
        "Action", "Failpoint", "FailpointSpecError", "arm", "armed", "catalogue", "check",
        "declared", "disarm", "disarm_all", "fired", "parse_spec", "set_process_rank",
        "wait_fired",
    ],
    "phalanx.rendezvous": [
        "BACKENDS", "Generation", "HandshakeAbortedError", "HandshakeError",
        "HandshakeTimeoutError", "HubCoordinator", "MarkerBackend", "RendezvousError",
        "StoreBackend", "SweepReport", "TokenMismatchError", "UnsafeRuntimeDirError",
        "default_runtime_dir", "ensure_private_dir", "handshake", "list_generations",
        "live_markers", "sweep",
    ],
    "phalanx.runtime": [
        "HubStuckError", "MessageTooLargeError", "Orchestrator", "Outcome",
        "ParentTimeoutError", "RankDiedError", "RankHungError", "RankServices",
        "RankStartError", "RemoteTaskError", "RunClosedError", "RunHandle",
        "RunSlotTimeoutError", "RunState", "RunsStuckError", "ServiceExistsError",
        "ServiceNotFoundError", "TaskFuture", "TaskTimeoutError", "WaitTimeoutError", "Worker",
        "WorkerClosedError", "WorkerError", "WorkerPoisonedError", "WorkerState", "WorkerStats",
        "current_rank", "generation", "job_token", "rank_services", "world_size",
    ],
    "phalanx.comm": [
        "BaseNotReadyError", "CollectiveError", "Domain", "DomainAllocationError",
        "DomainError", "DomainOrchestrator", "DomainReleasedError", "DomainSpecError",
        "DomainState", "DomainView", "Worker", "view_of",
    ],
    "phalanx.kvstore": [
        "CacheError", "CacheStats", "CapacityError", "DiskFullError", "DiskStore",
        "ForeignStoreError", "Geometry", "GeometryMismatchError", "Job", "JobKind",
        "JobOutcome", "KeyChain", "LoadTimeoutError", "NotCachedError", "PageScatter",
        "RecordCorruptError",
        "RowSpanError", "SEAL_NAME", "SNAPSHOT_NAME", "StoreClosedError", "StoreLockedError",
        "StoreOptions", "StoreResult", "StoreWriteError", "Tokens", "aligned_empty",
        "fingerprint_digest", "page_keys",
    ],
    "phalanx.replication": [
        "KVSource", "KVSourceFactory", "Leader", "Lease", "LinkAuthError", "LinkClosedError",
        "LinkProtocolError", "LinkStalledError", "MaintainReport", "PeerJobError", "RankCache",
        "ReplicaDivergedError", "ReplicatedCache", "ReplicationError", "StoreTicket",
        "SyntheticSource", "check_states", "rank_cache", "rank_directories",
    ],
    "phalanx.hosts": [
        "AgentExit", "HostAgent", "HostDomain", "HostDomainView", "HostLostError",
        "JoinFrame", "Membership", "MultiHostWorker", "NodeSpec", "Peer", "RemoteError",
        "VERSION", "VerdictFrame", "function_name", "local_addr_towards", "rendezvous",
        "view_of",
    ],
    "phalanx.engine": [
        "CompletionOutput", "DomainComm", "Engine", "EngineConfig", "HostsDiskCache",
        "LLM",
        "Logprob", "PageLoad", "PageSave", "PrefixTier", "RequestOutput", "SamplingParams",
        "SamplingSpec", "Scheduler", "SchedulerConfig", "SeqChunk", "StepDelta", "StepPlan",
        "StepResult",
        "TokenLogprobs", "Tokenizer", "TorchDistComm", "default_model_dir", "rank_env",
    ],
    "phalanx.serve": [],
    "phalanx.errors": [
        "BaseNotReadyError", "CacheError", "CapacityError", "CheckpointError", "CleanupError",
        "CollectiveError", "DiskFullError", "DomainAllocationError", "DomainError",
        "DomainReleasedError", "DomainSpecError", "EngineDeadError", "EngineError",
        "FailpointError", "FailpointSpecError", "ForeignStoreError", "GeometryMismatchError",
        "GrammarError", "HandshakeAbortedError", "HandshakeError", "HandshakeTimeoutError",
        "HubStuckError",
        "LinkAuthError", "LinkClosedError", "LinkProtocolError", "LinkStalledError",
        "LoadTimeoutError", "MessageTooLargeError", "ModelConfigError", "NotCachedError",
        "ParentTimeoutError", "PeerJobError", "PhalanxError", "RankDiedError", "RankHungError",
        "RankStartError", "RecordCorruptError", "RemoteTaskError", "RendezvousError",
        "ReplicaDivergedError", "ReplicationError", "RequestError", "ResourceError",
        "ResourceReleasedError", "ResourceUncertainError", "RowSpanError", "RunClosedError",
        "RunSlotTimeoutError", "RunsStuckError", "SamplingParamsError", "SchedulerError",
        "ServiceExistsError", "ServiceNotFoundError", "StepFailedError", "StoreClosedError",
        "StoreLockedError",
        "StoreWriteError", "TaskTimeoutError", "TokenMismatchError", "UnsafeRuntimeDirError",
        "WaitTimeoutError", "WorkerClosedError", "WorkerError", "WorkerPoisonedError",
    ],
}

# Exception classes of an _errors.py that are not errors phalanx raises, and so stay out
# of phalanx.errors: qualified name -> why.
NOT_RAISED = {
    "phalanx.runtime._errors.RemoteTraceback":
        "carries a remote traceback's text as a task error's __cause__; never raised",
}


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_package_all_is_pinned(package: str) -> None:
    module = importlib.import_module(package)
    names = getattr(module, "__all__", None)
    assert names is not None, f"{package} declares no __all__"
    assert sorted(names) == PUBLIC[package], f"{package}.__all__ changed"
    assert len(set(names)) == len(names), f"{package}.__all__ lists a name twice"
    for name in names:
        assert hasattr(module, name), f"{package}.__all__ names {name!r}, which is missing"


def _error_classes() -> dict[str, type[BaseException]]:
    """Every exception class defined in any layer's _errors.py: qualified name -> class."""
    found: dict[str, type[BaseException]] = {}
    for path in sorted(SRC.glob("*/_errors.py")):
        module = importlib.import_module(f"phalanx.{path.parent.name}._errors")
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException)
                    and obj.__module__ == module.__name__):
                found[f"{module.__name__}.{name}"] = obj
    return found


def test_errors_holds_every_layers_error_tree() -> None:
    classes = _error_classes()
    assert len(classes) >= 50
    for qualified, cls in classes.items():
        if qualified in NOT_RAISED:
            continue
        assert issubclass(cls, PhalanxError), f"{qualified} does not derive from PhalanxError"
        assert getattr(phalanx.errors, cls.__name__, None) is cls, (
            f"{qualified} is missing from phalanx.errors")
        assert cls.__name__ in phalanx.errors.__all__
    for name in phalanx.errors.__all__:
        obj = getattr(phalanx.errors, name)
        assert inspect.isclass(obj) and issubclass(obj, PhalanxError), name


def test_errors_docstring_draws_the_real_tree() -> None:
    """Each drawn class's parent (by indentation) is one of its real bases; none is missing."""
    doc = phalanx.errors.__doc__ or ""
    stack: list[tuple[int, str]] = []
    drawn: set[str] = set()
    for line in doc.splitlines():
        match = re.match(r"^(\s*(?:[│ ]\s*)*(?:[├└]── )?)([A-Z]\w+Error)\b", line)
        if match is None:
            continue
        depth, name = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= depth:
            stack.pop()
        cls = getattr(phalanx.errors, name)
        if stack:
            parent = getattr(phalanx.errors, stack[-1][1])
            assert parent in cls.__bases__, f"{name} is drawn under {stack[-1][1]}"
        stack.append((depth, name))
        drawn.add(name)
    assert drawn == set(phalanx.errors.__all__), sorted(set(phalanx.errors.__all__) ^ drawn)


def test_layers_import_without_torch() -> None:
    code = ("import sys, phalanx, phalanx.lifecycle, phalanx.runtime, phalanx.errors, "
            "phalanx.kvstore, phalanx.rendezvous; "
            "assert 'torch' not in sys.modules, 'torch imported eagerly'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
