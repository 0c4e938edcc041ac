"""The docs/architecture.md incident end to end, through the server: directories a TP 3 job left
(a 2,000-record chain, 7 of every 8 rows redundant) reopened by ``phalanx serve --tp 3``
past ``--prefix-cache-max-age``, and again with a tenth of the capacity. Each time the
server starts, answers completions while its maintenance runs, and every rank's
directory converges to the same state."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from replication_util import assert_identical, copy_dirs, dir_bytes
from serve_util import Server, model_env
from waits import wait_for

TP = 3
RECORDS = 2000
# heads and KV heads divide by 3; one layer of 16-dim float16 heads: 4 KiB pages keep
# 2,000 records of up to 8 pages small on disk
MODEL = ["--layers", "1", "--hidden", "48", "--heads", "3", "--kv-heads", "3",
         "--intermediate", "96", "--vocab", "512", "--dtype", "float16"]


def _cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "phalanx.serve.cli._main", *args],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("incident")
    model = base / "model"
    _cli("model", "init", str(model), *MODEL)
    cache = base / "cache"
    _cli("cache", "synth", str(cache), "--tp", str(TP), "--records", str(RECORDS),
         "--shape", "chain", "--uncompacted", "--model", str(model))
    return model, cache


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["expired", "tenth_capacity"])
def test_serve_reopens_the_incident_directories_and_converges(
        template: tuple[Path, Path], tmp_path: Path, scenario: str) -> None:
    model, tpl = template
    cache = copy_dirs(tpl, tmp_path / "cache")
    full = dir_bytes(cache / "rank-0")
    flags = (["--prefix-cache-max-age", "0.001"] if scenario == "expired"
             else ["--prefix-cache-disk-size", str(full // 10)])
    s = Server(str(model), "--tp", str(TP), "--prefix-cache-disk", str(cache), *flags,
               env=model_env(tmp_path))
    try:
        # answered while the burst runs behind it (the requests share the links' windows)
        for i in range(3):
            r = s.client.post("/v1/completions", json={"prompt": f"request {i}",
                                                       "max_tokens": 4})
            assert r.status_code == 200, r.text
        assert s.health() == 200

        def converged() -> bool:
            records = s.metric_by_label("phalanx:cache_disk_records")
            settled = s.metric("phalanx:cache_maintenance_queue") == 0
            if not (settled and len(set(records.values())) == 1 and len(records) == TP):
                return False
            if scenario == "expired":
                return all(v == 0 for v in records.values())
            return sum(s.metric_by_label("phalanx:cache_disk_bytes").values()) <= \
                TP * (full // 10)

        wait_for(converged, 600, "every rank's disk tier to finish its maintenance")
    finally:
        assert s.stop() == 0
    files = assert_identical(cache, TP)
    if scenario == "expired":
        assert files == []
    else:
        assert 0 < sum(size for _, size in files) <= full // 10
