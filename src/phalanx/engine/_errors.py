"""Errors of the engine layer.

    PhalanxError
    └── EngineError
        ├── ModelConfigError      a config field the engine cannot honour (a ValueError too)
        ├── CheckpointError       a checkpoint that cannot be read or does not fit the config
        ├── EngineDeadError       a rank died or the engine was closed: every request fails
        ├── RequestError          one request is refused or failed; the engine lives on
        │   ├── SamplingParamsError   invalid sampling parameters (a ValueError too)
        │   └── StepFailedError       the parent's own step code failed for this request
        └── SchedulerError        an invariant of the scheduler or page pool was broken
"""

from __future__ import annotations

from phalanx.lifecycle import PhalanxError

__all__ = [
    "CheckpointError",
    "EngineDeadError",
    "EngineError",
    "GrammarError",
    "ModelConfigError",
    "RequestError",
    "SamplingParamsError",
    "SchedulerError",
    "StepFailedError",
]


class EngineError(PhalanxError):
    """Base of the engine's errors."""


class ModelConfigError(EngineError, ValueError):
    """A model config field the engine cannot honour; the message names field and value."""


class CheckpointError(EngineError):
    """A checkpoint that cannot be read, or whose tensors do not fit the config."""


class EngineDeadError(EngineError):
    """The engine cannot serve any more (a rank died, or it was closed)."""


class RequestError(EngineError):
    """One request was refused or failed; the engine serves the others."""


class SamplingParamsError(RequestError, ValueError):
    """Sampling parameters out of range; the message names the field and value."""


class GrammarError(RequestError, ValueError):
    """A structured-output grammar (a JSON schema, a regex, a grammar) the engine cannot
    compile; the message names the part (issue 46)."""


class StepFailedError(RequestError):
    """The engine's own step code in the parent (encoding the plan) failed on this
    request's part of a step: a bug, reported as this request's error; the step ran on
    no rank and the engine serves on (issue 45)."""


class SchedulerError(EngineError):
    """An invariant of the scheduler or the page pool does not hold (a bug, not a request error)."""
