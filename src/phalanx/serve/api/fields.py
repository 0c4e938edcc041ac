"""Every field of OpenAI's request bodies, and what this server does with it (issue 46).

Each field of a request is one of three kinds; ``tests/test_serve_fields.py`` reads the
installed ``openai`` package's TypedDicts and fails on a field that is in none of them
or in two, so a new openai release cannot slip a field past unnoticed:

- **honoured**: it does what OpenAI documents (``n``, ``seed``, ``stop``, ...);
- **informational**: accepted and ignored because it cannot change the answer (who
  asks, labels, routing hints of OpenAI's own service);
- **refused**: a 400 naming it (``param``) and saying why, unless its value asks for
  nothing (``null``, or the neutral value listed: ``frequency_penalty: 0``,
  ``store: false``, ``logit_bias: {}``), which clients that send every field do.

A field that is neither OpenAI's nor one of the vLLM extensions listed here is a 400
too (``forbid_unknown_fields`` on the request structs, the message written by
:func:`unknown_field`): a misspelt field, or another server's extension, would
otherwise change nothing without a word.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import APIError

__all__ = ["CHAT", "COMPLETIONS", "RESPONSES", "Fields", "Refused", "check_refused",
           "unknown_field"]


@dataclass(frozen=True)
class Refused:
    """Why a field is refused, and the values that ask for nothing (accepted)."""

    reason: str
    neutral: tuple[Any, ...] = (None,)


@dataclass(frozen=True)
class Fields:
    """One endpoint's table: OpenAI's fields by kind, and the extensions it honours."""

    endpoint: str
    honoured: frozenset[str]
    informational: frozenset[str]
    refused: Mapping[str, Refused]
    extensions: frozenset[str] = frozenset()


_FUNCTIONS = ("OpenAI's deprecated functions API is not served: send tools and "
              "tool_choice instead (the same functions, as function tools)")
_PENALTY = "the sampler has no frequency or presence penalties; send 0 or omit it"
_NO_STATE = "this server keeps no state: send store=false or omit it"
_CACHE = ("the prefix cache is automatic (memory and disk tiers, keyed by the prompt's "
          "tokens) and takes no options; omit it")
_COMMON_REFUSED = {
    "frequency_penalty": Refused(_PENALTY, (None, 0)),
    "presence_penalty": Refused(_PENALTY, (None, 0)),
    "logit_bias": Refused("the sampler takes no logit bias; omit it", (None, {})),
}
_OPENAI_ONLY = "a feature of OpenAI's hosted service; omit it"
# informational everywhere: who asks, labels, and hints to OpenAI's own routing
_INFO = frozenset({"user", "metadata", "service_tier", "safety_identifier",
                   "prompt_cache_key"})
# vLLM's sampling extensions this server honours (docs/design.md, issue 46)
_VLLM = frozenset({"top_k", "stop_token_ids", "ignore_eos", "structured_outputs"})

CHAT = Fields(
    endpoint="chat completions",
    honoured=frozenset({"messages", "model", "max_completion_tokens", "max_tokens", "n",
                        "seed", "stop", "stream", "stream_options", "temperature",
                        "top_p", "logprobs", "top_logprobs", "response_format",
                        "tools", "tool_choice", "parallel_tool_calls"}),
    informational=_INFO,
    refused={
        **_COMMON_REFUSED,
        "audio": Refused("this server generates text only; omit it"),
        "modalities": Refused("this server generates text only", (None, ["text"])),
        "function_call": Refused(_FUNCTIONS),
        "functions": Refused(_FUNCTIONS, (None, [])),
        "prediction": Refused("predicted outputs are not supported; omit it"),
        "reasoning_effort": Refused("the served model does not reason; omit it",
                                    (None, "none")),
        "verbosity": Refused("the served model takes no verbosity; omit it"),
        "web_search_options": Refused(f"web search is {_OPENAI_ONLY}"),
        "moderation": Refused(f"moderation is {_OPENAI_ONLY}"),
        "prompt_cache_options": Refused(_CACHE),
        "prompt_cache_retention": Refused(_CACHE, (None, "in_memory")),
        "store": Refused(_NO_STATE, (None, False)),
    },
    extensions=_VLLM,
)

COMPLETIONS = Fields(
    endpoint="completions",
    honoured=frozenset({"model", "prompt", "logprobs", "max_tokens", "n", "seed", "stop",
                        "stream", "stream_options", "temperature", "top_p"}),
    informational=frozenset({"user"}),
    refused={
        **_COMMON_REFUSED,
        "best_of": Refused("best_of is not supported (vLLM dropped it too); send n "
                           "choices and rank them", (None, 1)),
        "echo": Refused("echo=true is not supported: the prompt is not returned",
                        (None, False)),
        "suffix": Refused("suffix (fill in the middle) is not supported", (None, "")),
    },
    # vLLM's completions take OpenAI chat's response_format too
    extensions=_VLLM | {"response_format"},
)

RESPONSES = Fields(
    endpoint="responses",
    honoured=frozenset({"input", "instructions", "max_output_tokens", "model", "stream",
                        "stream_options", "temperature", "top_p", "text", "tools",
                        "tool_choice", "parallel_tool_calls"}),
    informational=_INFO,
    refused={
        "store": Refused(_NO_STATE, (None, False)),
        "previous_response_id": Refused(
            "this server keeps no state (responses are not stored), so there is no "
            "previous response to continue: send the whole conversation as input items"),
        "conversation": Refused(
            "this server keeps no state (no conversations are stored): send the whole "
            "conversation as input items"),
        "background": Refused("background responses need stored state, which this "
                              "server does not keep", (None, False)),
        "background_options": Refused("background responses are not supported"),
        "prompt": Refused("stored prompt templates are a feature of OpenAI's hosted "
                          "service; send instructions and input instead"),
        "max_tool_calls": Refused("a response's function calls are not capped; omit it"),
        "include": Refused("no additional output data can be included", (None, [])),
        "reasoning": Refused("the served model does not reason; omit it"),
        "top_logprobs": Refused("logprobs are not returned by /v1/responses here; use "
                                "/v1/chat/completions", (None, 0)),
        "truncation": Refused("the input is never truncated: a prompt over the context "
                              "is a 400", (None, "disabled")),
        "context_management": Refused("context management is not supported", (None, [])),
        "access_programs": Refused(_OPENAI_ONLY),
        "image": Refused("this server generates text only; omit it"),
        "moderation": Refused(f"moderation is {_OPENAI_ONLY}"),
        "prompt_cache_options": Refused(_CACHE),
        "prompt_cache_retention": Refused(_CACHE, (None, "in_memory")),
    },
)


def _neutral(value: Any, neutral: Any) -> bool:
    if neutral is None or isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral  # false is no 0, 0 is no false
    return bool(value == neutral)


def check_refused(request: Any, fields: Fields) -> None:
    """A 400 naming the first refused field whose value asks for something."""
    for name, rule in fields.refused.items():
        value = getattr(request, name)
        if not any(_neutral(value, n) for n in rule.neutral):
            raise APIError(400, f"{name} is not supported by this server's "
                           f"{fields.endpoint}: {rule.reason}", param=name,
                           code="unsupported_field")


def unknown_field(name: str, path: str, fields: Fields | None) -> APIError:
    """The 400 for a field no struct declares (msgspec's ``forbid_unknown_fields``)."""
    param = f"{path}.{name}" if path else name
    if fields is None or path:
        return APIError(400, f"unknown field {param!r}: this server does not know it; "
                        f"remove it", param=param, code="unknown_field")
    ext = ", ".join(sorted(fields.extensions)) or "none"
    return APIError(400, f"unknown field {name!r}: it is not a field of OpenAI's "
                    f"{fields.endpoint} request, nor one of the extensions this server "
                    f"honours ({ext}); remove it (a field nobody reads would be "
                    f"ignored without a word)", param=param, code="unknown_field")
