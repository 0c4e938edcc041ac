"""``phalanx bench structured`` (issue 46's benchmark): structured outputs against
unconstrained on the real model, at tiny sizes (``--quick``). Shapes and what the server
reported, never a timing: the machine is shared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from phalanx_bench.structured import command
from real_model import fetch

PHALANX = str(Path(sys.executable).parent / "phalanx")


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def test_bad_input_is_one_line_and_exit_2() -> None:
    r = CliRunner().invoke(command, ["--clients", "0"])
    assert r.exit_code == 2 and "--clients" in r.output and "Traceback" not in r.output


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_both_sides_measured_on_the_real_model() -> None:
    gguf = fetch()
    proc = subprocess.run([PHALANX, "bench", "structured", "--quick", "--json"],
                          capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["model"] == gguf.name and r["cpu"]["model"]
    for case in ("throughput_tps", "decode_tps_b1"):
        assert set(r[case]) == {"structured", "unconstrained"}
        assert all(_number(v) for v in r[case].values())
    assert set(r["ratios"]) == {"throughput", "decode_b1"}
    assert all(_number(v) for v in r["ratios"].values())
    assert isinstance(r["goals"]["throughput_0.9x"], bool)
    compile_ms = r["grammar_compile_ms"]
    assert _number(compile_ms["new_schema_ttft_ms"]) and _number(
        compile_ms["cached_schema_ttft_ms"])
    # both sides generated the same tokens: the unconstrained one asks for each
    # constrained answer's length with ignore_eos (4 clients of at most 16 tokens)
    lengths = r["output_tokens_per_client"]
    assert len(lengths) == 4 and all(2 <= n <= 16 for n in lengths)
    assert r["bursts"]["unconstrained"]["output_tokens"] == sum(lengths)
    assert r["bursts"]["structured"]["requests"] == 4
