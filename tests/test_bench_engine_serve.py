"""Smoke tests of ``phalanx bench engine`` and ``phalanx bench serve`` at tiny sizes
(``--quick``): each runs end to end as a real command and its last line is the JSON
object the issues name (14 and 15). Shapes only, never a timing: the machine is shared.
The serve benchmark leaves no server behind (its ``finally`` stops and reaps them)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from click.testing import CliRunner

PHALANX = str(Path(sys.executable).parent / "phalanx")


def _bench(*args: str, timeout: float) -> dict[str, Any]:
    proc = subprocess.run([PHALANX, "bench", *args, "--quick", "--json"],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0


def test_both_are_commands() -> None:
    from phalanx_bench.cli import bench

    for name in ("engine", "serve"):
        sub = CliRunner().invoke(bench, [name, "--help"])
        assert sub.exit_code == 0, (name, sub.output)
        assert "--json" in sub.output and "--quick" in sub.output


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_engine_json_shape() -> None:
    r = _bench("engine", timeout=880)
    assert set(r["ttft_ms"]) == {"miss", "memory_hit", "disk_hit"}
    assert all(_number(v) for v in r["ttft_ms"].values())
    assert _number(r["prefill_tps"])
    assert set(r["decode_tps"]) == {"b1", "b16"}
    assert all(_number(v) for v in r["decode_tps"].values())
    t = r["transformers"]
    assert _number(t["ttft_ms_miss"]) and set(t["decode_tps"]) == {"b1", "b16"}
    assert "b16_mode" in t
    assert set(r["allreduce_us"]) == {"shm", "gloo"}
    assert all(_number(v) for v in r["allreduce_us"].values())
    assert {"layers", "hidden", "path"} <= set(r["model"])
    assert set(r["goals"]) == {"allreduce_20x", "disk_hit_10x", "b16_2x_transformers"}
    m = r["models"]["default"]
    assert m["disk_cached_tokens"] > 0
    # the repeat after the restart is served at least as much from disk as the prompt
    # that shares 95% of another's tokens (whole pages: 3 of 4 each at --quick's 256)
    assert _number(m["ttft_ms_disk_hit_shared_95"])
    assert m["disk_cached_fraction"] >= m["disk_cached_fraction_shared_95"] > 0


def _bench_servers(since: float) -> list[str]:
    """Servers the serve benchmark started (its own command lines) still running."""
    out = []
    for p in psutil.process_iter(["cmdline", "create_time"]):
        cmd = " ".join(p.info["cmdline"] or [])
        ours = ("--tp 2 --host 127.0.0.1 --port 0" in cmd
                or ("transformers serve" in cmd and "--device cpu --dtype float32" in cmd))
        if ours and (p.info["create_time"] or 0) >= since:
            out.append(cmd)
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_serve_json_shape() -> None:
    since = time.time()
    r = _bench("serve", timeout=880)
    assert set(r["ttft_ms"]) == {"miss", "memory_hit", "disk_hit"}
    assert all(_number(v) for v in r["ttft_ms"].values())
    assert _number(r["itl_ms_p50"])
    assert set(r["throughput_tps"]) == {"cache", "no_cache"}
    assert all(_number(v) for v in r["throughput_tps"].values())
    assert isinstance(r["miss_overhead"], float)
    t = r["transformers"]
    assert {"ttft_ms_miss", "itl_ms_p50", "throughput_tps"} <= set(t)
    if "error" in t:   # transformers serve could not start here: it says why
        assert isinstance(t["error"], str) and t["error"]
    else:
        assert all(_number(t[k]) for k in ("ttft_ms_miss", "itl_ms_p50", "throughput_tps"))
    assert r["phalanx"]["disk_hit"]["cached_tokens"] > 0
    assert r["phalanx"]["disk_hit_shared_95"]["cached_tokens"] > 0
    assert _number(r["ttft_ms_disk_hit_shared_95"])
    assert set(r["goals"]) == {"disk_hit_10x", "miss_no_slower_than_transformers",
                               "throughput_2x_transformers", "miss_overhead_under_5pct"}
    assert _bench_servers(since) == []
