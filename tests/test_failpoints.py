"""The failpoint mechanism itself."""

from __future__ import annotations

import pytest

import phalanx  # noqa: F401  (declares the catalogue)
from phalanx.lifecycle import FailpointError, failpoints
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
