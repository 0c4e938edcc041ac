"""``phalanx cache inspect`` and ``verify`` on real directories, through the root CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from cache_util import GEOM, Stores, page_row, record_files, stores
from phalanx.serve.cli._main import cli

__all__ = ["stores"]

PT = GEOM.page_tokens


def _fill(stores: Stores, d: Path) -> None:
    s = stores.open(d)
    toks = np.arange(8 * PT)
    s.store(toks[: 2 * PT], page_row(toks[: 2 * PT]))
    s.store(toks, page_row(toks))  # overlaps the first: one thinnable row
    s.store(np.arange(100, 100 + PT), page_row(np.arange(100, 100 + PT)))
    s.close()
    (d / "stray.bin").write_bytes(b"?")


def test_inspect_reports_records_depths_thinnable_and_skips(
    tmp_path: Path, stores: Stores
) -> None:
    _fill(stores, tmp_path)
    res = CliRunner().invoke(cli, ["cache", "inspect", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output.strip().splitlines()[-1])
    assert rep["records"] == 3 and rep["thinnable"] == 1 and rep["thinned"] == 0
    assert rep["depth_histogram"] == {"1": 1, "2-3": 1, "8-15": 1}
    assert rep["skipped"] == [["stray.bin", "foreign_name"]]
    assert rep["bytes"] == sum(os.path.getsize(tmp_path / n) for n in record_files(tmp_path))
    text = CliRunner().invoke(cli, ["cache", "inspect", str(tmp_path)])
    assert text.exit_code == 0 and "thinnable  1" in text.output


def test_verify_exits_non_zero_on_corruption(tmp_path: Path, stores: Stores) -> None:
    _fill(stores, tmp_path)
    ok = CliRunner().invoke(cli, ["cache", "verify", str(tmp_path), "--json"])
    assert ok.exit_code == 0 and json.loads(ok.output)["checked"] == 3
    name = max(record_files(tmp_path), key=lambda n: os.path.getsize(tmp_path / n))
    with open(tmp_path / name, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    bad = CliRunner().invoke(cli, ["cache", "verify", str(tmp_path), "--json"])
    assert bad.exit_code == 1
    rep = json.loads(bad.output)
    assert rep["ok"] is False and rep["corrupt"] == [[name, "page 7 checksum"]]


def _flip_last_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


def test_inspect_and_verify_read_every_rank_of_a_servers_directory(tmp_path: Path) -> None:
    """The directory given to ``--prefix-cache-disk`` holds a store per rank and none at
    its top: read from there, verify said "0 records checked: ok" while rank 1 held a
    corrupt record, and inspect said 0 records (issue 45)."""
    d = tmp_path / "prefix-cache"
    runner = CliRunner()
    made = runner.invoke(cli, ["cache", "synth", str(d), "--tp", "2", "--records", "6"])
    assert made.exit_code == 0, made.output
    ins = runner.invoke(cli, ["cache", "inspect", str(d), "--json"])
    assert ins.exit_code == 0, ins.output
    rep = json.loads(ins.output)
    assert rep["records"] == 12 and rep["skipped"] == [], rep
    assert {r: rank["records"] for r, rank in rep["ranks"].items()} == {"0": 6, "1": 6}
    assert rep["bytes"] == sum(rank["bytes"] for rank in rep["ranks"].values()) > 0
    text = runner.invoke(cli, ["cache", "inspect", str(d)])
    assert text.exit_code == 0 and "rank-1" in text.output, text.output
    assert "records    12 " in text.output, text.output

    ok = runner.invoke(cli, ["cache", "verify", str(d), "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["checked"] == 12

    name = record_files(d / "rank-1")[0]
    _flip_last_byte(d / "rank-1" / name)
    bad = runner.invoke(cli, ["cache", "verify", str(d), "--json"])
    assert bad.exit_code == 1, bad.output
    rep = json.loads(bad.output)
    assert rep["ok"] is False and rep["checked"] == 12, rep
    assert [c[0] for c in rep["corrupt"]] == [f"rank-1/{name}"], rep
    assert rep["ranks"]["0"]["ok"] is True and rep["ranks"]["1"]["ok"] is False, rep
    text = runner.invoke(cli, ["cache", "verify", str(d)])
    assert text.exit_code == 1
    assert f"rank-1/{name}" in text.output and "1 corrupt" in text.output, text.output
