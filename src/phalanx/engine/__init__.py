"""The engine layer (see DESIGN.md, Layers): step plans, sampling, the KV page pool, the
scheduler, the parent-side engine loop and ``LLM``.

Importing this package does not import torch: the modules that need it (the model, the
runner, sampling's ``sample``) import it when they run.
"""

from .engine import Engine, EngineConfig
from .llm import LLM
from .outputs import CompletionOutput, Logprob, RequestOutput
from .plan import PageLoad, PageSave, SamplingSpec, SeqChunk, StepPlan, StepResult, TokenLogprobs
from .sampling import SamplingParams
from .scheduler import InMemoryTier, PrefixTier, Scheduler, SchedulerConfig

__all__ = [
    "LLM",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
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
]
