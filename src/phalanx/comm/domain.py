"""The parent's handle of a domain, and how it turns into a view inside a task."""

from __future__ import annotations

import enum
from typing import Any

from ._errors import DomainError, DomainReleasedError
from .spec import DomainSpec

__all__ = ["Domain", "DomainState"]


class DomainState(enum.Enum):
    LIVE = "live"  # usable: tasks may be given it
    REVOKED = "revoked"  # released logically: no new use; physical release at the run fence
    RELEASED = "released"  # every member freed its resources
    UNCERTAIN = "uncertain"  # a release step failed; see ``error`` (still owned, counted)


class Domain:
    """What ``allocate_domain`` returns. Pass it to tasks on member ranks: there it
    arrives as that rank's :class:`~phalanx.comm.view.DomainView`."""

    def __init__(self, spec: DomainSpec, run_id: int) -> None:
        self.spec = spec
        self.run_id = run_id
        self.state = DomainState.LIVE
        self.error: BaseException | None = None

    name = property(lambda self: self.spec.name)
    alloc_id = property(lambda self: self.spec.alloc_id)
    members = property(lambda self: self.spec.members)

    def __repr__(self) -> str:
        return (f"<Domain {self.spec.name!r} id={self.spec.alloc_id} ranks="
                f"{list(self.spec.members)} {self.state.value}>")

    def __reduce__(self) -> tuple[Any, tuple[int, str]]:
        if self.state is not DomainState.LIVE:
            raise DomainReleasedError(
                f"domain {self.spec.name!r} (id {self.spec.alloc_id}) is {self.state.value}: "
                f"it cannot be given to new tasks")
        return (_resolve_view, (self.spec.alloc_id, self.spec.name))


def view_of(alloc_id: int, name: str) -> Any:
    """This rank's view of the live domain ``alloc_id`` (``name`` for the error), from a
    task: what a task that got the domain as an argument holds, for one that got its id
    (a task sent from another host, whose arguments are typed values, not pickles)."""
    return _resolve_view(alloc_id, name)


def _resolve_view(alloc_id: int, name: str) -> Any:
    """Runs in the rank when a task's arguments are unpickled."""
    from .rank_state import rank_comm

    st = rank_comm()
    view = st.views.get(alloc_id)
    if view is None:
        raise DomainError(f"rank {st.rank} holds no view of domain {name!r} (id {alloc_id}): "
                          f"it is not a member, or the domain was released")
    return view
