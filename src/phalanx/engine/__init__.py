"""The engine layer (see DESIGN.md, Layers): step plans, sampling, the KV page pool, the
scheduler, the parent-side engine loop and ``LLM``.

Importing this package does not import torch: the modules that need it (the model, the
runner, sampling's ``sample``) import it when they run.
"""

from typing import TYPE_CHECKING, Any

from .default_model import default_model_dir
from .engine import Engine, EngineConfig
from .host_disk import HostsDiskCache
from .llm import LLM
from .outputs import CompletionOutput, Logprob, RequestOutput
from .plan import PageLoad, PageSave, SamplingSpec, SeqChunk, StepPlan, StepResult, TokenLogprobs
from .ranks import rank_env
from .sampling import SamplingParams
from .scheduler import InMemoryTier, PrefixTier, Scheduler, SchedulerConfig
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .tp import DomainComm, TorchDistComm

# the TP communicators import torch: loaded on first use, so this package still does not
_LAZY = {"DomainComm": ".tp", "TorchDistComm": ".tp"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

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
    "InMemoryTier",
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
    "StepPlan",
    "StepResult",
    "TokenLogprobs",
    "Tokenizer",
    "TorchDistComm",
    "default_model_dir",
    "rank_env",
]
