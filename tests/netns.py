"""Real hosts on one machine for the tests: ``phalanx_bench.netns`` with a skip.

The harness itself (namespaces joined by veth pairs and a bridge, 10.77.0.x/24, teardown
in ``finally``) lives in ``src/phalanx_bench/netns.py`` so that ``phalanx bench
multihost`` can use it without importing from tests/; see its docstring. This wrapper
keeps the tests' API: ``with hosts(n) as nodes:`` skips the test, with the reason,
where namespaces cannot be created.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from phalanx_bench.netns import (
    SUBNET,
    Host,
    NetnsError,
    NetnsUnavailable,
    namespaces_of_this_run,
    skip_reason,
)
from phalanx_bench.netns import hosts as _hosts

__all__ = ["SUBNET", "Host", "NetnsError", "hosts", "namespaces_of_this_run", "skip_reason"]


@contextlib.contextmanager
def hosts(n: int) -> Iterator[list[Host]]:
    """``n`` hosts on one bridge, removed on the way out; the test is skipped where
    namespaces cannot be made."""
    made = _hosts(n)
    try:
        nodes = made.__enter__()
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    # the body's exception goes to the harness's teardown, which re-raises it
    with contextlib.ExitStack() as stack:
        stack.push(made)
        yield nodes
