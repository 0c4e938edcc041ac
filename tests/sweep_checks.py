"""What every failpoint-sweep scenario checks (tests/test_failpoint_sweep.py and its
engine and serve scenarios, tests/sweep_engine.py): the error reached the caller naming
the point and the rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from test_domain_faults import _texts

Problems = dict[str, list[str]]  # point -> what did not hold (empty: all held)


def reached(point: str, rank: int | None, errors: list[BaseException]) -> list[str]:
    """The error reached the caller naming the point and, where there is one, the rank."""
    text = "\n".join(t for e in errors for t in _texts(e))
    if not errors:
        return ["no error reached the caller"]
    out = []
    if point not in text:
        out.append(f"the error does not name the step: {text[:300]!r}")
    if rank is not None and f"rank {rank}" not in text:
        out.append(f"the error does not name rank {rank}: {text[:300]!r}")
    return out


def attempt(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[BaseException]:
    """Call ``fn`` now; the exception it raised, if any."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001  inspected by the scenario
        return [exc]
    return []
