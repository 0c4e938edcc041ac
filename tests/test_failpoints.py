"""The failpoint mechanism itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import phalanx
from phalanx.lifecycle import FailpointError, failpoints
from phalanx.lifecycle.catalogue import layer_of
from phalanx.lifecycle.failpoints import Failpoint, FailpointSpecError


@pytest.fixture(autouse=True)
def _disarm() -> object:
    yield
    failpoints.disarm_all()


def test_catalogue_lists_declared_points() -> None:
    names = failpoints.catalogue()
    assert "rank.task.received" in names and "worker.close.stop_ranks" in names


def test_skip_and_times() -> None:
    fp = Failpoint("test.only.point", "a point for this test")
    failpoints.arm(fp.name, "raise@2*1")
    fp.hit()
    fp.hit()
    with pytest.raises(FailpointError, match=r"test\.only\.point"):
        fp.hit()
    fp.hit()  # fired its one time
    assert failpoints.fired(fp.name) == 1


def test_unknown_name_and_bad_spec_are_refused() -> None:
    with pytest.raises(FailpointSpecError, match="unknown failpoint"):
        failpoints.arm("no.such.point")
    with pytest.raises(FailpointSpecError, match="bad failpoint spec"):
        failpoints.arm("rank.task.received", "explode")


def test_env_arming() -> None:
    failpoints.arm_from_env("rank.task.received=hang:0.01;worker.run.admitted=raise")
    assert failpoints.armed() == {"rank.task.received": "hang:0.01",
                                  "worker.run.admitted": "raise"}


def test_a_name_outside_the_catalogue_is_refused_at_declaration() -> None:
    with pytest.raises(FailpointSpecError, match="not in the catalogue"):
        Failpoint("cache.store.temp_opend")  # a typo of a real point
    with pytest.raises(FailpointSpecError, match="declared twice"):
        Failpoint("worker.run.admitted")  # phalanx.runtime.worker declares it


def test_every_catalogued_point_is_declared_by_the_code_and_nothing_else() -> None:
    """The table and the declarations agree once every module of phalanx is imported."""
    src = Path(phalanx.__file__).parent
    carriers = sorted(".".join(("phalanx", *p.relative_to(src).with_suffix("").parts))
                      for p in src.rglob("*.py") if "failpoints import Failpoint" in p.read_text()
                      and p.parent.name != "lifecycle")
    assert len(carriers) >= 8
    code = (
        "import importlib\n"
        "from phalanx.lifecycle import failpoints\n"
        f"for m in {carriers!r}:\n"
        "    importlib.import_module(m)\n"
        "extra = sorted(set(failpoints.catalogue()) - set(failpoints.declared()))\n"
        "assert not extra, f'catalogued but declared by no module: {extra}'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_import_phalanx_alone_can_arm_the_whole_catalogue_from_the_environment() -> None:
    names = failpoints.catalogue()
    assert {layer_of(n) for n in names} >= {"rendezvous", "runtime", "comm", "kvstore",
                                            "replication"}
    code = (
        "import sys, phalanx\n"
        "from phalanx.lifecycle import failpoints\n"
        "failpoints.arm_from_env()\n"
        "assert 'torch' not in sys.modules\n"
        "print(len(failpoints.armed()))\n"
    )
    env = {**os.environ, failpoints.ENV_VAR: failpoints.encode_env(
        dict.fromkeys(names, "raise@1000000"))}
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=env,
                         capture_output=True, text=True)
    assert int(out.stdout) == len(names)


def _armed_here() -> dict[str, str]:
    return failpoints.armed()


def test_a_worker_arms_the_whole_catalogue_at_rank_start() -> None:
    """``Worker(failpoints=)`` reaches ranks that imported only phalanx (kvstore points too)."""
    names = failpoints.catalogue()
    # Armed to fire after a million hits: every point is live, none fires.
    with phalanx.Worker(ranks=1, failpoints=dict.fromkeys(names, "raise@1000000")) as w:
        armed = w.run(lambda o: o.submit(0, _armed_here).result())
    assert sorted(armed) == sorted(names)


def test_a_worker_refuses_an_unknown_point_before_starting_ranks() -> None:
    with pytest.raises(FailpointSpecError, match=r"unknown failpoint 'cache\.store\.temp_opend'"):
        phalanx.Worker(ranks=1, failpoints={"cache.store.temp_opend": "raise"})
    with pytest.raises(FailpointSpecError, match="bad failpoint spec"):
        phalanx.Worker(ranks=1, failpoints={"cache.store.temp_opened": "explode"})
