"""Start-up reconciliation: what every rank must change so all hold the same records.

Each rank recovered its own directory; a crash can leave them different (a peer killed
mid-burst missed the last jobs, a disk lost files). Rank 0 collects every rank's record
set (key -> thinned) and plans:

* ``discard``: records not held by every rank. They are dropped everywhere, never
  restored: a record's bytes live only on the rank that wrote them, and no rank can
  rebuild another's shard. What only they made reachable becomes orphans, which
  maintenance drops on every rank.
* ``thin``: records held everywhere but thinned on some rank. Thinning is idempotent,
  so every rank applies it (a no-op where already thinned).

Afterwards each rank reports the digest of its record set; the job serves only when all
digests equal rank 0's (else ReplicaDivergedError).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["ReconcilePlan", "plan"]


@dataclass
class ReconcilePlan:
    discard: list[bytes] = field(default_factory=list)
    thin: list[bytes] = field(default_factory=list)
    missing: dict[int, int] = field(default_factory=dict)  # rank -> records it lacked
    extra: dict[int, int] = field(default_factory=dict)  # rank -> records only it had

    @property
    def empty(self) -> bool:
        return not self.discard and not self.thin

    def summary(self) -> str:
        return (f"{len(self.discard)} records dropped everywhere, {len(self.thin)} thinned "
                f"everywhere; missing per rank {self.missing}, extra per rank {self.extra}")


def plan(states: Mapping[int, Mapping[bytes, bool]]) -> ReconcilePlan:
    """The plan for ``states`` (rank -> that rank's key -> thinned)."""
    sets = {rank: set(s) for rank, s in states.items()}
    union: set[bytes] = set().union(*sets.values())
    common: set[bytes] = set.intersection(*sets.values()) if sets else set()
    out = ReconcilePlan(discard=sorted(union - common))
    for rank, keys in sets.items():
        if len(common) != len(union):
            out.missing[rank] = len(union - keys)
            out.extra[rank] = sum(1 for k in keys - common if all(
                k not in other for r, other in sets.items() if r != rank))
    out.thin = sorted(k for k in common if any(s[k] for s in states.values())
                      and not all(s[k] for s in states.values()))
    return out
