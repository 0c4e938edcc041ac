"""The engine layer (see docs/architecture.md, Layers): step plans, sampling, the KV page pool, the
scheduler, the parent-side engine loop and ``LLM``.

Importing this package does not import torch: the modules that need it (the model, the
runner, sampling's ``sample``) import it when they run.
"""

import importlib
from typing import TYPE_CHECKING, Any

from .core.outputs import CompletionOutput, Logprob, RequestOutput, StepDelta
from .core.plan import (
    PageLoad,
    PageSave,
    SamplingSpec,
    SeqChunk,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from .core.sampling import SamplingParams
from .core.scheduler import PrefixTier, Scheduler, SchedulerConfig
from .engine import Engine, EngineConfig
from .llm import LLM
from .model.default_model import default_model_dir
from .model.tokenizer import Tokenizer
from .multihost.disk import HostsDiskCache
from .worker.local import rank_env

if TYPE_CHECKING:
    from .worker.tp import DomainComm, TorchDistComm

# the TP communicators import torch: loaded on first use, so this package still does not
_LAZY = {"DomainComm": ".worker.tp", "TorchDistComm": ".worker.tp"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "LLM",
    "CompletionOutput",
    "DomainComm",
    "Engine",
    "EngineConfig",
    "HostsDiskCache",
    "Logprob",
    "PageLoad",
    "PageSave",
    "PrefixTier",
    "RequestOutput",
    "SamplingParams",
    "SamplingSpec",
    "Scheduler",
    "SchedulerConfig",
    "SeqChunk",
    "StepDelta",
    "StepPlan",
    "StepResult",
    "TokenLogprobs",
    "Tokenizer",
    "TorchDistComm",
    "default_model_dir",
    "rank_env",
]
