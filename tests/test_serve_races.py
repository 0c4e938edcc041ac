"""Races of the server's engine edges found by reading (issue 34), each driven through
the supervisor's and driver's public seams with real engines, and each shown to fail
before its fix:

* an engine that dies while the supervisor is still installing it is healed again
  (before: its death report was dropped, and the server stayed 503 for good);
* a request admitted while the engine dies fails at once (before: its stream was
  registered after the death's snapshot of the streams and received nothing until
  the server closed).

The interleavings are made with a failpoint that pauses a thread at a step
(``pause``), and with rank processes killed by the test, not with timers.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from phalanx.engine import SamplingParams
from phalanx.engine.model.default_model import default_model_dir
from phalanx.errors import EngineDeadError
from phalanx.lifecycle import failpoints
from phalanx.serve.driver import EngineDriver
from phalanx.serve.server import ServerConfig, _starter
from phalanx.serve.supervisor import Supervisor
from waits import wait_for

WAIT_S = 120.0


def _start_fn() -> Callable[[Callable[[BaseException], None]], EngineDriver]:
    cfg = ServerConfig(tensor_parallel_size=1, prefix_cache_disk="", max_num_seqs=4)
    return _starter(cfg, Path(default_model_dir()), "seeded")


def _rank_pids() -> set[int]:
    """This process's rank processes (the engines' ranks)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "phalanx.runtime.rank_main" in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.Error:
            continue
    return out


def _kill_ranks_of(start: Callable[[], EngineDriver]) -> tuple[EngineDriver, set[int]]:
    before = _rank_pids()
    driver = start()
    ranks = _rank_pids() - before
    assert ranks, "the engine started no rank process"
    return driver, ranks


def _kill(pids: set[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


def test_an_engine_that_dies_while_it_is_installed_is_healed_again() -> None:
    real = _start_fn()
    started: list[EngineDriver] = []

    def start(on_death: Callable[[BaseException], None]) -> EngineDriver:
        driver, ranks = _kill_ranks_of(lambda: real(on_death))
        started.append(driver)
        if len(started) == 2:
            # the restart's engine dies before the supervisor has installed it: its
            # driver notices and reports it while the heal is still in progress
            _kill(ranks)
            wait_for(lambda: not driver.health().ok, WAIT_S,
                     "the restarted engine's driver to see its rank die")
        return driver

    first_ranks = _rank_pids()
    sup = Supervisor(start, restart=True, max_restarts=5)
    try:
        _kill(_rank_pids() - first_ranks)
        wait_for(lambda: sup.restart_count >= 2 and sup.health().ok, WAIT_S,
                 "the supervisor to heal the engine that died while it was installed")
        assert len(started) == 3
    finally:
        sup.close()


def test_a_request_admitted_as_the_engine_dies_fails_at_once() -> None:
    driver, ranks = _kill_ranks_of(lambda: _start_fn()(lambda exc: None))
    outcome: dict[str, Any] = {}

    async def consume() -> None:
        async for delta in driver.generate("r1", [5, 6, 7, 8], SamplingParams(max_tokens=4)):
            outcome.setdefault("deltas", []).append(delta)

    def client() -> None:
        try:
            asyncio.run(consume())
            outcome["result"] = "finished"
        except BaseException as exc:  # noqa: BLE001  inspected by the test
            outcome["result"] = exc

    failpoints.arm("serve.driver.admit", "pause*1")
    thread = threading.Thread(target=client, name="test-client")
    try:
        thread.start()
        assert failpoints.wait_fired("serve.driver.admit", 1, WAIT_S), "never admitted"
        _kill(ranks)  # the request is held past its first check while the engine dies
        wait_for(lambda: not driver.health().ok, WAIT_S, "the driver to see the rank die")
        failpoints.disarm("serve.driver.admit")
        thread.join(30.0)
        assert not thread.is_alive(), ("the request admitted as the engine died got "
                                       "nothing: it waits for the server to close")
        assert isinstance(outcome["result"], EngineDeadError), outcome
    finally:
        failpoints.disarm_all()
        driver.close()
        thread.join(WAIT_S)
