"""A run holds what is outstanding, not every task it ever ran (issue 45).

The engine ran every step as tasks inside one run that lasts the process's life (until
issue 43's step channel). That run kept each TaskFuture it created (two per step at TP 2,
~1.5 KB each) until it ended, so a server grew 4 MB per 1,000 short requests for good.
``Worker.stats().tasks_retained`` counts what the live runs hold; these tests read it
from inside a long run.
"""

from __future__ import annotations

import pytest

import phalanx


def double(x: int) -> int:
    return 2 * x


def fail(msg: str) -> None:
    raise KeyError(msg)


# At a look, one future may be settled but not yet let go: the hub thread wakes the
# waiter first and drops the future from its run right after. Nothing else may remain.
_SLACK = 2


def test_a_long_run_that_takes_its_results_retains_o1_tasks() -> None:
    retained: list[int] = []

    def orch(o: phalanx.Orchestrator, steps: int) -> int:
        total = 0
        for step in range(steps):
            # the engine's shape: one task per rank per step, every result taken
            futs = [o.submit(r, double, step) for r in o.ranks]
            total += sum(f.result() for f in futs)
            if step in (steps // 4, steps - 1):
                retained.append(w.stats().tasks_retained)
        return total

    with phalanx.Worker(ranks=2) as w:
        steps = 400
        assert w.run(orch, steps) == 2 * 2 * sum(range(steps))
        assert max(retained) <= _SLACK, retained
        assert w.stats().tasks_retained == 0  # the run retired


def test_batches_in_flight_are_retained_until_taken() -> None:
    seen: list[tuple[int, int]] = []

    def orch(o: phalanx.Orchestrator) -> None:
        for _ in range(40):
            futs = [o.submit(r % 2, double, r) for r in range(8)]
            before = w.stats().tasks_retained  # what is in flight is held, nothing more
            assert [f.result() for f in futs] == [2 * r for r in range(8)]
            seen.append((before, w.stats().tasks_retained))

    with phalanx.Worker(ranks=2) as w:
        w.run(orch)
    assert all(b <= 8 + _SLACK and a <= _SLACK for b, a in seen), seen


def test_failures_looked_at_are_not_retained_and_do_not_fail_the_run() -> None:
    def orch(o: phalanx.Orchestrator) -> int:
        for i in range(200):
            with pytest.raises(KeyError):
                o.submit(i % 2, fail, "seen").result()
        return int(w.stats().tasks_retained)

    with phalanx.Worker(ranks=2) as w:
        assert w.run(orch) <= _SLACK


def test_a_failure_nobody_looked_at_still_fails_a_long_run() -> None:
    """Released futures must not take an unobserved failure with them: the failure
    settles first, hundreds of tasks later the run still fails with it."""

    def orch(o: phalanx.Orchestrator) -> None:
        for i in range(200):
            o.submit(i % 2, double, i).result()
        o.submit(1, fail, "silent").wait_settled()  # settled, never looked at
        for i in range(200):
            o.submit(i % 2, double, i).result()

    with phalanx.Worker(ranks=2) as w:
        with pytest.raises(KeyError, match="silent"):
            w.run(orch)
        assert w.stats().tasks_retained == 0


def test_a_failure_looked_at_after_it_settled_does_not_fail_the_run() -> None:
    def orch(o: phalanx.Orchestrator) -> list[int]:
        late = o.submit(0, fail, "late")
        late.wait_settled()  # settled before anyone looked: the run holds it
        held = [w.stats().tasks_retained]
        assert isinstance(late.exception(), KeyError)  # the look lets it go at once
        held.append(w.stats().tasks_retained)
        return held

    with phalanx.Worker(ranks=2) as w:
        assert w.run(orch) == [1, 0]
