"""What a rank process knows about itself; read by tasks through :func:`current_rank`."""

from __future__ import annotations

_RANK: int | None = None
_WORLD_SIZE: int | None = None
_GENERATION: str | None = None


def set_rank(rank: int) -> None:
    global _RANK
    _RANK = rank


def set_world(world_size: int, generation: str) -> None:
    global _WORLD_SIZE, _GENERATION
    _WORLD_SIZE, _GENERATION = world_size, generation


def current_rank() -> int | None:
    """The rank of this process, or None in a parent (non-rank) process."""
    return _RANK


def world_size() -> int | None:
    return _WORLD_SIZE


def generation() -> str | None:
    return _GENERATION
