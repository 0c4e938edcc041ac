"""Closing a replicated cache: every rank's every step runs, and every failure comes
back in one CleanupError naming each rank (never a list of strings, never an error in
``__context__``); a failed step stays owed and the ranks' shutdown retries it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from phalanx.lifecycle import CleanupError, FailpointError
from phalanx.runtime import Worker
from replication_util import GEOM, RANKS, assert_identical, open_cache


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


def test_two_ranks_failing_to_close_come_back_in_one_error(tmp_path: Path) -> None:
    d = tmp_path / "cache"
    with Worker(ranks=RANKS) as w:
        cache = open_cache(w, d)
        assert cache.store(np.arange(3 * GEOM.page_tokens)).stored
        # the last step of each peer's store close (releasing the directory lock) fails
        w.arm_failpoint("cache.close.lock", "raise*1", ranks=[1, 2])
        with pytest.raises(CleanupError) as info:
            cache.close()
        err = info.value
        assert "rank 1" in str(err) and "rank 2" in str(err), err
        assert err.__context__ is None  # collected explicitly, not chained
        fired = [e for e in _leaves(err) if isinstance(e, FailpointError)]
        assert sorted(e.rank for e in fired if e.rank is not None) == [1, 2], _leaves(err)
        assert [n for e in err.exceptions for n in getattr(e, "__notes__", [])
                if n.startswith("rank ")] == ["rank 1", "rank 2"]
        cache.close()  # idempotent: the parent asked once; what is owed is the ranks'
    # the Worker's close retried the owed steps in the ranks (the failpoint fired once):
    # every lock is released, nothing leaked (the session fixture checks)
    assert assert_identical(d) != []
    with Worker(ranks=RANKS) as w:  # the directories open again: the locks are free
        cache = open_cache(w, d)
        try:
            assert cache.lookup(np.arange(3 * GEOM.page_tokens)) == 3
            assert cache.check() == []
        finally:
            cache.close()
