"""``phalanx bench fidelity`` (issue 44): KL and top-1 agreement of phalanx's quantized
path and llama.cpp's against their own float32 models, on the real model. The full run
(the whole text, four files) is a benchmark; here two short chunks check the command
end to end and the JSON's shape, where the pinned llama.cpp build exists."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx_bench.fidelity import parse_kld
from phalanx_bench.llamacpp_build import perplexity_path, quantize_path
from real_model import fetch

PHALANX = str(Path(sys.executable).parent / "phalanx")

# the tail of llama-perplexity's --kl-divergence statistics, as the pinned build prints it
_STATS = """====== KL divergence statistics ======
Mean    KLD:   0.002740 ±   0.000068
Maximum KLD:   0.019115
====== Token probability statistics ======
RMS Δp    :  1.183 ± 0.055 %
Same top p: 96.667 ± 0.562 %
"""


def test_llama_perplexitys_statistics_are_read() -> None:
    assert parse_kld(_STATS) == (0.002740, 0.96667)


def test_a_missing_model_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = subprocess.run([PHALANX, "bench", "fidelity", "--model", str(tmp_path / "x.gguf")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "x.gguf" in proc.stderr and "does not exist" in proc.stderr


@pytest.mark.slow  # a benchmark's quick run, as the other bench smoke tests
def test_the_json_holds_both_engines_and_their_ratios() -> None:
    for tool in (quantize_path(), perplexity_path()):
        if not tool.exists():
            pytest.skip(f"no {tool.name} at {tool}: bench/setup_llamacpp.sh builds it")
    # 2 x 63 scored positions: llama-perplexity prints no statistics under 100
    proc = subprocess.run([PHALANX, "bench", "fidelity", "--model", str(fetch()), "--n-ctx",
                           "128", "--chunks", "2", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["bench"] == "fidelity" and doc["n_ctx"] == 128 and doc["cpu"]
    (row,) = doc["rows"]
    assert row["positions"] == 2 * (128 // 2 - 1)
    for side in ("phalanx", "llamacpp"):
        assert 0 <= row[side]["kl"] < 1 and 0.5 < row[side]["top1"] <= 1, row
    assert row["ratio"]["kl"] == pytest.approx(row["phalanx"]["kl"] / row["llamacpp"]["kl"])
