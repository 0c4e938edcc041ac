"""The disk tier: one connector with two sides, between the scheduler and each rank's disk.

- the scheduler's side, :class:`~phalanx.engine.disk.tier.DiskTier` (``tier.py``): the
  engine loop's ``KVConnector`` (``core/connector.py``): lookups, the loads a step
  carries, the background stores and maintenance;
- rank 0's side (``rank0.py``): the lookups, leases and their release, run on rank 0;
- each rank's side (``staging.py``): the rank's staging, through which its runner's
  pages reach its store and come back;
- ``identity.py``: what a served model's tier is keyed by (the operator commands
  derive the same).

The contract, both sides:

Rank 0 decides (``phalanx.replication``'s rank-side API): a lookup is one task on rank 0
through the rank group's serving run (``rank0.rank_lookup``: ``lookup_many`` pins what it
reports in a :class:`~phalanx.replication.Lease`). The step that consumes the pages
carries the leases (``rank0.DiskLoads``) beside its plan; while executing the plan's
``PageLoad`` each rank reads its own shard with ``load_many`` straight into the runner's
buffer (``staging.py``), then into its KV pages. Rank 0 releases the leases when
the step ran (every rank loaded before the forward's collectives). A lookup the
scheduler gives back (``unpin``: the request did not fit) is released with the next
lookup.

A miss asks no rank: the tier keeps the set of page keys rank 0 holds (its answer at
open, refreshed after maintenance did work, plus every chain queued for a store), and a
lookup whose first wanted key is not in it returns 0 at once. The set may hold keys
rank 0 has since evicted (then the lookup is asked and answers 0), never lack one it
holds: a store adds its keys before it runs, and a refresh keeps the keys of every
store not yet run (the refresh runs on the stores' thread, between two stores). A new
prompt thus costs no round trip to rank 0 before its first step, which in a busy server
would come between two steps of everyone decoding.

A load that fails on a rank (a record missing or corrupt there, an I/O error) is a
miss, not an error: the ranks agree on it before the forward (``Runner._agree``), none
runs the step, rank 0 still releases the leases, the scheduler recomputes what was to
be loaded, and ``DiskTier.load_failed`` counts it and logs each rank's reason.

Stores run on one background thread, in the order their steps ran: a step's
``PageSave`` staged the pages on every rank, ``saved(chain)`` queues the chain, the
thread asks rank 0 to store it (rank 0 admits, makes room, replicates). The request
path never waits on a disk write, and the thread waits for a quiet moment of the ranks
(``Executor.wait_quiet``: 50 ms without a step; a store at most 1 s after it was
queued) before each store and maintenance burst, so back-to-back requests do not
share their cores with it. A store that fails (disk full, a failpoint, pages
pushed out of staging) or that finds the queue full is counted and dropped: it costs
a later miss, never a wrong answer. The thread also runs the cache's maintenance in
bounded bursts while it is idle, less and less often while there is nothing to do.
"""
