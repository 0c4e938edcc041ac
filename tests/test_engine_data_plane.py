"""Steps ride the engine's own step channel, not the runtime's tasks (issue 43).

Before, every step was a pickled task per rank inside one run that lasted the engine's
life, and each left its futures there: the runtime grew with every step served. Now a
step is written once into shared memory and read by every rank's loop; the Worker's
counters show that no step makes a task, and the answers are those the ranks computed.
"""

from __future__ import annotations

import os
import signal

import pytest

from phalanx import LLM, SamplingParams
from phalanx.errors import EngineDeadError


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_no_step_makes_a_runtime_task_and_nothing_grows_with_steps() -> None:
    with LLM(tensor_parallel_size=2) as llm:
        (warm,) = llm.generate("warm up", _greedy(4))
        worker = llm.engine.executor.worker
        before = worker.stats()
        outs = llm.generate(["Once upon a time", "The capital of", "1, 2, 3,",
                             "Hello"], _greedy(48))
        after = worker.stats()
        assert [len(o.outputs[0].token_ids) for o in outs] == [48] * 4
        # 48+ steps served, and not one task for them (a step once was one per rank)
        assert after.tasks_submitted == before.tasks_submitted
        assert after.tasks_retained <= before.tasks_retained
        # the same answer alone as in the batch: what the ranks computed, step by step
        (alone,) = llm.generate("Once upon a time", _greedy(48))
        assert alone.outputs[0].token_ids == outs[0].outputs[0].token_ids
        assert warm.outputs[0].finish_reason == "length"


def test_a_rank_killed_between_steps_fails_the_next_step_naming_it() -> None:
    with LLM(tensor_parallel_size=2) as llm:
        llm.generate("warm up", _greedy(2))
        pids = llm.engine.executor.on_each_rank(os.getpid, timeout=30)
        pid = pids[1]
        assert isinstance(pid, int)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=r"rank\S* \[?1"):
            llm.generate("after the kill", _greedy(8))
