"""The failpoint catalogue: every named failpoint of phalanx, grouped by layer.

The table lives here, in the lowest layer, so the whole catalogue is known as soon as
:mod:`phalanx.lifecycle.failpoints` is imported: a process that did only
``import phalanx`` can arm a kvstore or replication point (through ``Worker(failpoints=)``
or ``PHALANX_FAILPOINTS``) before the module that carries it is imported, and that
module's own import never decides whether a name exists. Importing nothing above
lifecycle keeps this free of torch and of every heavy module.

``Failpoint(name)`` refuses a name that is not in this table, so a typo at a
declaration site fails at import, and a point added to the code without a row here
(and so without a scenario in tests/test_failpoint_sweep.py) fails the build.

A description starts with ``parent:`` or ``rank:`` where the point is hit only in the
parent or only in rank processes; the domain fault sweep relies on that prefix.

Names keep the ``cache.`` prefix of the layer they were born in (before the split into
kvstore and replication): renaming them would break every operator's spec string for no
behavioural gain. Their layer is the key they are filed under.
"""

from __future__ import annotations

__all__ = ["LAYERS", "POINTS", "layer_of"]

#: Layer -> failpoint name -> what has happened (or is about to) when it is hit.
POINTS: dict[str, dict[str, str]] = {
    "lifecycle": {},
    "rendezvous": {
        "rendezvous.handshake.publish": "about to publish a marker or key",
        "rendezvous.handshake.remove": "the leader is about to remove markers",
        "rendezvous.remove.unlink": "about to unlink one file of a generation",
    },
    "kvstore": {
        "cache.close.lock": "close is about to release the directory's lock (its last step)",
        "cache.close.seal": "close wrote the snapshot; about to seal it",
        "cache.load.pinned": "load planned, records pinned, not yet read",
        "cache.purge.unlinking": "stale temp file about to be unlinked",
        "cache.quarantine.moving": "bad file about to be moved aside",
        "cache.remove.unlinking": "record file about to be unlinked",
        "cache.store.committed": "record renamed into place, not indexed",
        "cache.store.temp_opened": "record temp file created, empty",
        "cache.store.temp_written": "record temp file written, not renamed",
        "cache.thin.committed": "thinned header renamed over the row",
        "cache.thin.temp_written": "thinned header written, not renamed",
        "cache.uring.enter": "about to submit to or wait on a ring (errno: the call fails)",
        "cache.uring.setup": "about to create the io_uring (errno: unavailable)",
    },
    "runtime": {
        "rank.start.before_hello": "rank: started, before HELLO",
        "rank.task.received": "rank: took a user task frame off its channel",
        "worker.close.stop_ranks": "parent: close() is about to stop the ranks",
        "worker.run.admitted": "parent: a run was admitted, before its thread",
        "worker.start.ranks_spawned": "parent: rank processes exist, not yet ready",
    },
    "comm": {
        "base.init.begin": "parent: about to create the base communicator",
        "base.init.peers_mapped": "rank: every peer's notify pool mapped",
        "base.init.pool_created": "rank: notify pool segment created",
        "base.init.pool_mapped": "rank: own notify pool mapped",
        "base.init.pool_unlinked": "rank: own notify pool name unlinked",
        "base.release.begin": "rank: releasing the base communicator",
        "base.release.peer_pool_unmap": "rank: about to unmap a peer's pool",
        "base.release.pool_unmap": "rank: about to unmap its own notify pool",
        "base.release.ranks": "parent: about to release the base on ranks",
        "domain.alloc.attached": "rank: past the 'attached' handshake",
        "domain.alloc.created": "rank: past the 'created' handshake",
        "domain.alloc.members_done": "parent: every member allocated",
        "domain.alloc.name_unlink": "rank: about to unlink its segment name",
        "domain.alloc.name_unlinked": "rank: own segment name unlinked",
        "domain.alloc.peer_mapped": "rank: one peer segment mapped",
        "domain.alloc.segment_created": "rank: domain segment name created",
        "domain.alloc.slot_borrowed": "rank: notify slot borrowed and zeroed",
        "domain.alloc.validated": "parent: spec checked, id and slot reserved",
        "domain.alloc.view_registered": "rank: view published to tasks",
        "domain.alloc.window_mapped": "rank: own segment mapped",
        "domain.release.logical": "parent: release_domain revokes the domain",
        "domain.release.peer_unmap": "rank: about to unmap a peer segment",
        "domain.release.physical": "parent: the fence releases the domain",
        "domain.release.quiesced": "rank: view revoked, peers about to be unmapped",
        "domain.release.revoked": "rank: view revoked, before quiesce handshake",
        "domain.release.slot_return": "rank: about to return the notify slot",
        "domain.release.window_unmap": "rank: about to unmap own segment",
    },
    "replication": {
        "cache.link.connect": "rank: a peer is about to connect to rank 0",
        "cache.link.send": "rank: rank 0's link writer is about to send a batch",
        "cache.replica.apply": "rank: a peer is about to apply one of rank 0's ops",
    },
    "engine": {
        "engine.disk.lookup": "parent: the scheduler's disk tier lookup is about to ask "
                              "rank 0 for a prompt's pages",
        "engine.step.encode": "parent: a scheduled step's plan is about to be encoded for "
                              "the ranks (the engine's own step code)",
        "engine.rank.step": "rank: a step message was read from the step channel; it is "
                            "about to run",
    },
    "serve": {
        "serve.driver.admit": "parent: a request passed its first admission check; its "
                              "stream is not yet registered with the engine thread",
        "serve.api.tokenize": "parent: a large prompt is about to be tokenized or "
                              "rendered off the event loop",
    },
}

#: The layers bottom to top, as in docs/architecture.md "Layers" (kvstore and rendezvous are peers).
LAYERS = tuple(POINTS)

_LAYER_OF = {name: layer for layer, points in POINTS.items() for name in points}


def layer_of(name: str) -> str | None:
    """The layer that carries failpoint ``name``, or ``None`` if it is not catalogued."""
    return _LAYER_OF.get(name)
