"""What a domain is: its members, window, named buffers, and the layout of its segment."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ._errors import DomainSpecError

__all__ = ["DomainSpec", "segment_name"]

PAGE = 4096
DEFAULT_SCRATCH = 1 << 20
_NAME = re.compile(r"^[A-Za-z0-9_.]{1,64}$")


def _round_up(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


def segment_name(generation: str, alloc_id: int, rank: int) -> str:
    """Unique per generation and allocation; the stale-generation sweep knows the prefix."""
    return f"phx-{generation}-d{alloc_id}-r{rank}"


@dataclass(frozen=True)
class DomainSpec:
    """A domain's shape. Every member's segment is ``[scratch | window]``: the scratch
    area stages collectives, the window is the user's (named buffers carved from it in
    declaration order)."""

    alloc_id: int
    name: str
    members: tuple[int, ...]
    window_size: int
    buffers: tuple[tuple[str, int], ...]
    scratch_size: int
    slot: int  # index of this domain's flags in every member's notify pool
    generation: str

    @property
    def window_offset(self) -> int:
        return self.scratch_size

    @property
    def segment_size(self) -> int:
        return self.scratch_size + _round_up(max(self.window_size, 1))

    def buffer_offsets(self) -> dict[str, tuple[int, int]]:
        out, offset = {}, 0
        for name, size in self.buffers:
            out[name] = (offset, size)
            offset += size
        return out

    @staticmethod
    def validate(name: str, members: Sequence[int], world: Sequence[int], window_size: int,
                 buffers: Sequence[tuple[str, int]], scratch_size: int) -> None:
        if not _NAME.match(name):
            raise DomainSpecError(f"domain name {name!r}: use 1-64 letters, digits, '_' or '.'")
        if not members:
            raise DomainSpecError(f"domain {name!r} needs at least one member rank")
        if len(set(members)) != len(members):
            raise DomainSpecError(f"domain {name!r}: member ranks {list(members)} repeat")
        strangers = [r for r in members if r not in world]
        if strangers:
            raise DomainSpecError(f"domain {name!r}: ranks {strangers} are not ranks of this "
                                  f"worker (ranks {list(world)})")
        if window_size < 0 or scratch_size < PAGE or scratch_size % PAGE:
            raise DomainSpecError(f"domain {name!r}: window_size must be >= 0 and scratch_size "
                                  f"a positive multiple of {PAGE}")
        names = [b for b, _ in buffers]
        if len(set(names)) != len(names):
            raise DomainSpecError(f"domain {name!r}: buffer names {names} repeat")
        total = sum(size for _, size in buffers)
        if any(size <= 0 for _, size in buffers) or total > window_size:
            raise DomainSpecError(
                f"domain {name!r}: buffers {list(buffers)} need {total} bytes but the window "
                f"has {window_size}; sizes must be positive")
