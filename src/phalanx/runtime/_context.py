"""What a rank process knows about itself; read by tasks through :func:`current_rank`."""

from __future__ import annotations

_RANK: int | None = None
_WORLD_SIZE: int | None = None
_GENERATION: str | None = None
_JOB_TOKEN: str | None = None


def set_rank(rank: int) -> None:
    global _RANK
    _RANK = rank


def set_world(world_size: int, generation: str, job_token: str) -> None:
    global _WORLD_SIZE, _GENERATION, _JOB_TOKEN
    _WORLD_SIZE, _GENERATION, _JOB_TOKEN = world_size, generation, job_token


def current_rank() -> int | None:
    """The rank of this process, or None in a parent (non-rank) process."""
    return _RANK


def world_size() -> int | None:
    return _WORLD_SIZE


def generation() -> str | None:
    return _GENERATION


def job_token() -> str | None:
    """The job token peers authenticate with (rank processes only; never log it)."""
    return _JOB_TOKEN
