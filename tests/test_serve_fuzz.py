"""The API fuzzed from outside: schemathesis reads the server's own ``/openapi.json``
and sends what it generates from it -- valid bodies at the edges of every range and
invalid ones of every kind -- to a real ``phalanx serve`` (issue 45). No response may
be a 5xx and every invalid body must be refused (4xx); after each batch the server is
healthy and a normal request is answered. The explicit attacks (a fan-out, an
overflow, a slow client, deep JSON, ...) are tests/test_serve_attacks.py.

The seed is fixed so a CI run is repeatable; ``PHALANX_FUZZ_SEED`` picks another, and
``PHALANX_FUZZ_EXAMPLES`` more examples per operation.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from serve_util import Server, model_env

pytestmark = pytest.mark.slow

SEED = os.environ.get("PHALANX_FUZZ_SEED", "45")
EXAMPLES = os.environ.get("PHALANX_FUZZ_EXAMPLES", "10")

# the batches: after each, the server must still serve
BATCHES = {
    "generation": r"^/v1/((chat/)?completions|responses)$",
    "the rest": r"^/(tokenize|detokenize|health|metrics|v1/models)$",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("fuzz-home")
    # a short context: whatever max_tokens the fuzzer picks, a request ends soon
    s = Server("--tp", "1", "--no-prefix-cache-disk", "--max-model-len", "256",
               env=model_env(home))
    yield s
    assert s.stop() == 0


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_no_generated_request_gets_a_server_error(server: Server, batch: str,
                                                  tmp_path: Path) -> None:
    schemathesis = Path(sys.executable).with_name("schemathesis")
    run = subprocess.run(
        [str(schemathesis), "run", server.url + "/openapi.json", "--no-color",
         "--checks", "not_a_server_error,negative_data_rejection",
         "--include-path-regex", BATCHES[batch], "--workers", "1",
         "--phases", "coverage,fuzzing", "--max-examples", EXAMPLES, "--seed", SEED,
         "--suppress-health-check", "all", "--report-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "SCHEMATHESIS_HOOKS": ""})
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout.split("SUMMARY")[-1]
    health = httpx.get(server.url + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["restarts"] == 0, health.text
    ok = httpx.post(server.url + "/v1/completions", timeout=60,
                    json={"prompt": "still serving", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
