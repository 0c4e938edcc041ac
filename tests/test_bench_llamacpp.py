"""``phalanx bench llamacpp`` (issue 33): phalanx serve beside llama.cpp's llama-server on
the real GGUF test model. Shapes and what each server reported, never a timing.

The llama-server binary is built by ``bench/setup_llamacpp.sh`` (minutes of compiling on
two cores, so CI does not build it); the end-to-end test runs where it was built and says
how to build it where it was not. The command's bad input is tested everywhere."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from phalanx_bench.llamacpp_build import server_path
from real_model import fetch

PHALANX = str(Path(sys.executable).parent / "phalanx")


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def test_a_missing_llama_server_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = subprocess.run([PHALANX, "bench", "llamacpp", "--llama-server",
                           str(tmp_path / "nowhere"), "--quick"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "setup_llamacpp.sh" in proc.stderr and str(tmp_path / "nowhere") in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_both_servers_measured_on_the_same_file() -> None:
    binary = server_path()
    if not binary.exists():
        pytest.skip(f"no llama-server at {binary}: bench/setup_llamacpp.sh builds it")
    gguf = fetch()
    proc = subprocess.run([PHALANX, "bench", "llamacpp", "--quick", "--json"],
                          capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["model"] == gguf.name and r["quant"] == "Q4_1"
    assert set(r["ttft_ms"]) == {"miss", "memory_hit", "disk_hit_after_restart"}
    lc = r["llamacpp"]
    assert set(lc["ttft_ms"]) == {"miss", "cache_hit", "after_restart"}
    for side in (r, lc):
        assert all(_number(v) for v in side["ttft_ms"].values())
        assert set(side["decode_tps"]) == {"b1", "b16"}
        assert all(_number(v) for v in side["decode_tps"].values())
        assert _number(side["throughput_tps_16_clients"]) and _number(side["rss_mb"])
        assert _number(side["memory_mb_at_rest"]["pss"])
        # both tokenized the same text alike: the same file's vocabulary
        assert side["tokens"]["miss"]["prompt_tokens"] == 256
    # the hits were hits: phalanx's whole pages from memory and, after its restart, from
    # disk; llama.cpp's slot reused all but the last token
    assert r["tokens"]["memory_hit"]["cached_tokens"] > 0
    assert r["tokens"]["disk_hit_after_restart"]["cached_tokens"] > 0
    assert lc["tokens"]["cache_hit"]["cached_tokens"] > 0
    assert set(r["goals"]) == {"throughput_1x", "restart_ttft_10x", "decode_b1_0.7x"}
    assert r["setup"]["threads"] >= 1 and r["setup"]["tp"] == 1
    # the same KV bytes on both sides: llama-server's f16 K and V for its --ctx tokens
    # (4,096 with --quick) of the real model's 30 layers x 3 KV heads x 64
    assert r["setup"]["kv_cache_size"] == 4096 * 30 * 2 * 3 * 64 * 2
    # the CPU the numbers hold for (issue 43)
    assert isinstance(r["cpu"]["model"], str) and r["cpu"]["model"]
    assert r["cpu"]["amx"] in (True, False, None)
