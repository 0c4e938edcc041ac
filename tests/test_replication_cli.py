"""``phalanx cache synth`` and ``phalanx cache maintain``: the incident reproduced
without a model, and offline compaction, eviction and expiry for operators."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from phalanx.serve.cli._main import cli
from replication_util import assert_identical


def test_synth_then_maintain_compacts_every_rank(tmp_path: Path) -> None:
    d = tmp_path / "cache"
    runner = CliRunner()
    res = runner.invoke(cli, ["cache", "synth", str(d), "--tp", "3", "--records", "400",
                              "--shape", "chain", "--uncompacted"])
    assert res.exit_code == 0, res.output
    assert "350 redundant rows" in res.output
    res = runner.invoke(cli, ["cache", "maintain", str(d), "--tp", "3", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert out["jobs"] == {"thin": 350}
    assert out["records_before"] == out["records_after"] == {"0": 400, "1": 400, "2": 400}
    assert out["problems"] == []
    assert_identical(d)
    res = runner.invoke(cli, ["cache", "maintain", str(d), "--tp", "3", "--max-age", "0.001",
                              "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert out["records_after"] == {"0": 0, "1": 0, "2": 0}
    assert assert_identical(d) == []
