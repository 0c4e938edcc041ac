"""``POST /v1/responses``'s request body: decoded by msgspec, its input turned into chat
messages for the model's template (issue 46).

Stateless: nothing is stored, so ``store: true``, ``previous_response_id``,
``conversation`` and ``background`` are 400s saying so (``fields.py``); the caller
sends the whole conversation as input items. ``input`` is a string (one user message)
or a list of items: messages (``{"role", "content"}`` with or without
``"type": "message"``; content a string or ``input_text`` / ``output_text`` parts).
``instructions`` goes first, as a system message, as OpenAI inserts it. ``text.format``
(``json_object``, or ``json_schema`` with its ``name``, ``schema`` and ``strict`` inline)
is chat's ``response_format`` under another shape: :meth:`ResponsesRequest.response_format`
turns it into that, for the same grammar (``structured.py``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec

from .errors import APIError
from .fields import RESPONSES, Fields, check_refused
from .protocol import JsonSchemaSpec, PositiveInt, ResponseFormat, Temperature, TopP

__all__ = ["ResponsesRequest", "ResponsesStreamOptions", "ResponsesText", "TextFormat"]

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = {"input_text", "output_text", "text"}
_NOT_YET = "not supported yet (issue 46's tool calls)"


class TextFormat(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``text.format``: plain text, any JSON object, or JSON matching ``schema``."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesText(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``text``: the output's format and verbosity (refused)."""

    format: TextFormat | None = None
    verbosity: Any = None


class ResponsesStreamOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    include_obfuscation: bool | None = None  # informational: no obfuscation is added


class ResponsesRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/responses``; ``fields.RESPONSES`` says what each field does here."""

    FIELDS: ClassVar[Fields] = RESPONSES

    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    model: str | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    text: ResponsesText | None = None
    # informational
    metadata: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    service_tier: Any = None
    user: Any = None
    # refused unless null or neutral
    access_programs: Any = None
    background: Any = None
    background_options: Any = None
    context_management: Any = None
    conversation: Any = None
    image: Any = None
    include: Any = None
    max_tool_calls: Any = None
    moderation: Any = None
    parallel_tool_calls: Any = None
    previous_response_id: Any = None
    prompt: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    reasoning: Any = None
    store: Any = None
    tool_choice: Any = None
    tools: Any = None
    top_logprobs: Any = None
    truncation: Any = None

    def check(self) -> None:
        check_refused(self, self.FIELDS)
        if self.input is None or self.input == [] or self.input == "":
            raise APIError(400, "input is required: a string, or a list of input items "
                           "(this server keeps no state to continue from)", param="input")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true",
                           param="stream_options")
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise APIError(400, "text.verbosity is not supported: the served model takes "
                           "no verbosity; omit it", param="text.verbosity",
                           code="unsupported_field")
        self.messages()  # every item is understood, before admission

    def response_format(self) -> ResponseFormat | None:
        """``text.format`` as chat's ``response_format`` (None: free text)."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return ResponseFormat(type="json_object")
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaSpec(
            name=fmt.name or "response", description=fmt.description, schema=fmt.schema,
            strict=fmt.strict))

    def messages(self) -> list[dict[str, str]]:
        """The chat messages this request stands for: instructions, then the input."""
        out: list[dict[str, str]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            out.append({"role": "user", "content": self.input})
            return out
        for i, item in enumerate(self.input or []):
            out.append(_message(i, item))
        return out


def _message(i: int, item: dict[str, Any]) -> dict[str, str]:
    kind = item.get("type", "message")
    if kind in ("function_call", "function_call_output"):
        raise APIError(400, f"input[{i}]: {kind} items are {_NOT_YET}",
                       param=f"input[{i}].type", code="unsupported_field")
    if kind != "message":
        raise APIError(400, f"input[{i}]: items of type {kind!r} are not supported; send "
                       f"messages ({{\"role\": ..., \"content\": ...}})",
                       param=f"input[{i}].type", code="unsupported_field")
    role = item.get("role")
    if role not in _ROLES:
        raise APIError(400, f"input[{i}].role must be one of {', '.join(_ROLES)}, not "
                       f"{role!r}", param=f"input[{i}].role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise APIError(400, f"input[{i}].content must be a string or a list of text "
                       f"parts", param=f"input[{i}].content")
    texts: list[str] = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"input[{i}].content[{j}]: only text parts "
                           f"({{\"type\": \"input_text\", \"text\": ...}}) are supported, "
                           f"not {kind!r}: this server serves a text model",
                           param=f"input[{i}].content[{j}]", code="unsupported_field")
        texts.append(part["text"])
    return {"role": role, "content": "".join(texts)}
