"""Every error phalanx raises, from every layer, in one place.

Catch :class:`PhalanxError` for anything phalanx raised, or a branch for one layer's
failures. Each layer defines its branch in its own ``_errors.py``; this module only
re-exports them (tests/test_public_api.py checks that nothing is missing). Errors that
cross a process boundary keep their type and fields (rank, point, missing ranks).

    PhalanxError                          (lifecycle: the root)
    ├── FailpointError                    a failpoint armed to raise was hit (names point, rank)
    ├── FailpointSpecError                a failpoint name or spec was not understood (ValueError)
    ├── CleanupError                      cleanup steps failed, every failure inside (a group)
    ├── ResourceError
    │   ├── ResourceUncertainError        a release step failed; the resource is still owned
    │   └── ResourceReleasedError         use of a resource after its release began
    ├── RendezvousError                   (rendezvous)
    │   ├── UnsafeRuntimeDirError         a symlink, foreign owner or a file (PermissionError)
    │   ├── HandshakeError                publishing or removing a marker (or key) failed
    │   │   ├── HandshakeTimeoutError     not every participant arrived in time (TimeoutError)
    │   │   └── HandshakeAbortedError     a participant gave up the allocation
    │   └── TokenMismatchError            a store peer presented the wrong job token
    ├── WorkerError                       (runtime)
    │   ├── WorkerClosedError             the worker is closing or closed: no new runs
    │   ├── WorkerPoisonedError           a cleanup failed or a rank died: only close() is left
    │   ├── RankStartError                a rank process did not become ready
    │   ├── RankDiedError                 a rank process exited while work was outstanding
    │   │   └── RankHungError             a rank is stopped (SIGSTOP) past a task deadline
    │   ├── TaskTimeoutError              a task ran past its deadline (TimeoutError)
    │   ├── WaitTimeoutError              a caller's own wait ended first (TimeoutError)
    │   ├── RunSlotTimeoutError           no run slot freed before admission's deadline (Timeout)
    │   ├── RunsStuckError                runs did not retire by the close deadline (Timeout)
    │   ├── HubStuckError                 the parent's IO thread did not stop a rank in time
    │   ├── ParentTimeoutError            a rank's request to its parent got no answer (Timeout)
    │   ├── RunClosedError                a run's orchestrator was used after its function returned
    │   ├── MessageTooLargeError          a control-channel message is over the limit (ValueError)
    │   ├── RemoteTaskError               a task's exception that could not cross as is
    │   ├── ServiceExistsError            a rank service of that name is already registered
    │   └── ServiceNotFoundError          no rank service of that name here (LookupError)
    ├── DomainError                       (comm)
    │   ├── DomainSpecError               a bad name, member list, size or layout (ValueError)
    │   ├── DomainAllocationError         allocation failed on some ranks; all rolled back
    │   ├── DomainReleasedError           a released (revoked) domain was used
    │   ├── BaseNotReadyError             a domain step on a rank without its base communicator
    │   └── CollectiveError               a barrier or collective did not complete (TimeoutError)
    ├── CacheError                        (kvstore: one rank's prefix store)
    │   ├── StoreLockedError              another live process holds the directory's lock
    │   ├── StoreClosedError              the store was used after close()
    │   ├── ForeignStoreError             the directory belongs to another model
    │   │   └── GeometryMismatchError     its geometry or format version differs
    │   ├── RowSpanError                  a row or token list that cannot be stored (ValueError)
    │   ├── CapacityError                 a row over the capacity, or nothing evictable
    │   ├── StoreWriteError               a record could not be written; nothing became visible
    │   │   └── DiskFullError             ... because the disk is full (ENOSPC)
    │   ├── RecordCorruptError            a record failed its checksum while being loaded
    │   ├── NotCachedError                load() asked for pages that are not cached (KeyError)
    │   ├── LoadTimeoutError              a load's reads did not finish by its deadline
    │   └── ReplicationError              (replication: rank 0 decides, peers mirror)
    │       ├── LinkAuthError             a job-token proof did not match
    │       ├── LinkProtocolError         a frame of another version, type or size arrived
    │       ├── LinkClosedError           the connection to a peer closed or failed
    │       ├── LinkStalledError          a peer made no progress on its jobs for job_timeout
    │       ├── PeerJobError              a peer applied a job and reported an error
    │       └── ReplicaDivergedError      after reconciliation the ranks' records still differ
    └── EngineError                       (engine)
        ├── ModelConfigError              a config field the engine cannot honour (ValueError)
        ├── CheckpointError               a checkpoint unreadable or not fitting the config
        ├── EngineDeadError               a rank died or the engine closed: every request fails
        ├── RequestError                  one request refused or failed; the engine lives on
        │   ├── SamplingParamsError       invalid sampling parameters (ValueError)
        │   ├── GrammarError              a structured-output grammar that cannot compile
        │   └── StepFailedError           the parent's step code failed on this request
        └── SchedulerError                an invariant of the scheduler or page pool broke

This module is the one place allowed to import the layers' private ``_errors`` modules
(tests/test_layers.py): it imports no layer's machinery beyond what their packages load.
"""

from __future__ import annotations

from phalanx.comm._errors import (
    BaseNotReadyError,
    CollectiveError,
    DomainAllocationError,
    DomainError,
    DomainReleasedError,
    DomainSpecError,
)
from phalanx.engine._errors import (
    CheckpointError,
    EngineDeadError,
    EngineError,
    GrammarError,
    ModelConfigError,
    RequestError,
    SamplingParamsError,
    SchedulerError,
    StepFailedError,
)
from phalanx.kvstore._errors import (
    CacheError,
    CapacityError,
    DiskFullError,
    ForeignStoreError,
    GeometryMismatchError,
    LoadTimeoutError,
    NotCachedError,
    RecordCorruptError,
    RowSpanError,
    StoreClosedError,
    StoreLockedError,
    StoreWriteError,
)
from phalanx.lifecycle._errors import (
    CleanupError,
    FailpointError,
    PhalanxError,
    ResourceError,
    ResourceReleasedError,
    ResourceUncertainError,
)
from phalanx.lifecycle.failpoints import FailpointSpecError
from phalanx.rendezvous._errors import (
    HandshakeAbortedError,
    HandshakeError,
    HandshakeTimeoutError,
    RendezvousError,
    TokenMismatchError,
    UnsafeRuntimeDirError,
)
from phalanx.replication._errors import (
    LinkAuthError,
    LinkClosedError,
    LinkProtocolError,
    LinkStalledError,
    PeerJobError,
    ReplicaDivergedError,
    ReplicationError,
)
from phalanx.runtime._errors import (
    HubStuckError,
    MessageTooLargeError,
    ParentTimeoutError,
    RankDiedError,
    RankHungError,
    RankStartError,
    RemoteTaskError,
    RunClosedError,
    RunSlotTimeoutError,
    RunsStuckError,
    ServiceExistsError,
    ServiceNotFoundError,
    TaskTimeoutError,
    WaitTimeoutError,
    WorkerClosedError,
    WorkerError,
    WorkerPoisonedError,
)

__all__ = [
    "BaseNotReadyError",
    "CacheError",
    "CapacityError",
    "CheckpointError",
    "CleanupError",
    "CollectiveError",
    "DiskFullError",
    "DomainAllocationError",
    "DomainError",
    "DomainReleasedError",
    "DomainSpecError",
    "EngineDeadError",
    "EngineError",
    "FailpointError",
    "FailpointSpecError",
    "ForeignStoreError",
    "GeometryMismatchError",
    "GrammarError",
    "HandshakeAbortedError",
    "HandshakeError",
    "HandshakeTimeoutError",
    "HubStuckError",
    "LinkAuthError",
    "LinkClosedError",
    "LinkProtocolError",
    "LinkStalledError",
    "LoadTimeoutError",
    "MessageTooLargeError",
    "ModelConfigError",
    "NotCachedError",
    "ParentTimeoutError",
    "PeerJobError",
    "PhalanxError",
    "RankDiedError",
    "RankHungError",
    "RankStartError",
    "RecordCorruptError",
    "RemoteTaskError",
    "RendezvousError",
    "ReplicaDivergedError",
    "ReplicationError",
    "RequestError",
    "ResourceError",
    "ResourceReleasedError",
    "ResourceUncertainError",
    "RowSpanError",
    "RunClosedError",
    "RunSlotTimeoutError",
    "RunsStuckError",
    "SamplingParamsError",
    "SchedulerError",
    "ServiceExistsError",
    "ServiceNotFoundError",
    "StepFailedError",
    "StoreClosedError",
    "StoreLockedError",
    "StoreWriteError",
    "TaskTimeoutError",
    "TokenMismatchError",
    "UnsafeRuntimeDirError",
    "WaitTimeoutError",
    "WorkerClosedError",
    "WorkerError",
    "WorkerPoisonedError",
]
