"""The engine's model side: configs, weights, layers, tokenizers.

The names in ``__all__`` are its public surface (the benchmarks score a model through
them: ``phalanx bench fidelity``). They load on first use (PEP 562): the parent
process reads configs and tokenizers through this package and must not import torch,
which the model's own modules need.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .attention import build_meta
    from .config import load_config
    from .gguf_file import forget_gguf_files
    from .tokenizer import Tokenizer
    from .transformer import CausalLM

__all__ = ["CausalLM", "Tokenizer", "build_meta", "forget_gguf_files", "load_config"]

_WHERE = {"CausalLM": ".transformer", "Tokenizer": ".tokenizer", "build_meta": ".attention",
          "forget_gguf_files": ".gguf_file", "load_config": ".config"}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(where, __name__), name)
