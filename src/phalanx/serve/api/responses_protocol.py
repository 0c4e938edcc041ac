"""``POST /v1/responses``'s request body: decoded by msgspec, its input turned into chat
messages for the model's template (issue 46).

Stateless: nothing is stored, so ``store: true``, ``previous_response_id``,
``conversation`` and ``background`` are 400s saying so (``fields.py``); the caller
sends the whole conversation as input items. ``input`` is a string (one user message)
or a list of items: messages (``{"role", "content"}`` with or without
``"type": "message"``; content a string or ``input_text`` / ``output_text`` parts).
``instructions`` goes first, as a system message, as OpenAI inserts it. Function
tools and their items are chat's under another shape: ``function_call`` items become
an assistant message's ``tool_calls`` (consecutive ones, one message), and
``function_call_output`` items ``tool`` messages, rendered by the tool-call layer
(``tools/``) through the model's template. ``text.format``
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

    input: str | list[dict[str, Any]]   # required: no state to continue from
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
        if self.input == [] or self.input == "":
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

    def messages(self) -> list[dict[str, Any]]:
        """The chat messages this request stands for: instructions, then the input."""
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            out.append({"role": "user", "content": self.input})
            return out
        for i, item in enumerate(self.input or []):
            kind = item.get("type", "message")
            _only_known_keys(f"input[{i}]", item, _ITEM_KEYS.get(kind))
            if kind == "function_call":
                call = _call(i, item)
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                out.append(_call_output(i, item))
            else:
                out.append(_message(i, kind, item))
        return out

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` (function tools, flat) in chat's shape (``{"function": {...}}``)."""
        if not self.tools:
            return None if self.tools is None else []
        if not isinstance(self.tools, list):
            raise APIError(400, "tools must be a list of function tools", param="tools")
        out = []
        for i, t in enumerate(self.tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else type(t).__name__
                raise APIError(400, f"tools[{i}]: only function tools are supported, not "
                               f"{kind!r} (hosted tools are OpenAI's service)",
                               param=f"tools[{i}].type", code="unsupported_field")
            _only_known_keys(f"tools[{i}]", t, _TOOL_KEYS)
            out.append({"type": "function", "function": {
                k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}})
        return out

    def chat_tool_choice(self) -> Any:
        """``tool_choice`` in chat's shape (a named function nests its name)."""
        c = self.tool_choice
        if isinstance(c, dict) and c.get("type") == "function" and "name" in c:
            return {"type": "function", "function": {"name": c["name"]}}
        if isinstance(c, dict):
            raise APIError(400, "tool_choice is \"none\", \"auto\", \"required\" or "
                           "{\"type\": \"function\", \"name\": ...}", param="tool_choice")
        return c


# An item's own keys, by type: what it is, and what an output item echoed back carries
# (``id``, ``status``: they describe an earlier answer and change nothing the model
# reads). Any other key is a 400 naming it, as at the request's top level.
_ITEM_KEYS: dict[str, frozenset[str]] = {
    "message": frozenset({"type", "role", "content", "id", "status"}),
    "function_call": frozenset({"type", "call_id", "name", "arguments", "id", "status"}),
    "function_call_output": frozenset({"type", "call_id", "output", "id", "status"}),
}
_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})


def _only_known_keys(where: str, obj: dict[str, Any], known: frozenset[str] | None) -> None:
    """A 400 naming ``where.key`` for a key this item cannot have (``known`` None: an
    item type the caller refuses itself)."""
    if known is None:
        return
    for key in obj:
        if key not in known:
            raise APIError(400, f"unknown field '{where}.{key}': not a key of this item; "
                           "remove it", param=f"{where}.{key}", code="unknown_field")


def _call(i: int, item: dict[str, Any]) -> dict[str, Any]:
    """A ``function_call`` item as a chat tool call."""
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise APIError(400, f"input[{i}].{key} must be a string (a function_call item "
                           f"has call_id, name and arguments)", param=f"input[{i}].{key}")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _call_output(i: int, item: dict[str, Any]) -> dict[str, Any]:
    """A ``function_call_output`` item as a chat ``tool`` message."""
    if not isinstance(item.get("call_id"), str):
        raise APIError(400, f"input[{i}].call_id must be a string",
                       param=f"input[{i}].call_id")
    output = item.get("output")
    text = output if isinstance(output, str) else _text(i, output, "output")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": text}


def _message(i: int, kind: str, item: dict[str, Any]) -> dict[str, Any]:
    if kind != "message":
        raise APIError(400, f"input[{i}]: items of type {kind!r} are not supported; send "
                       f"messages, function_call and function_call_output items",
                       param=f"input[{i}].type", code="unsupported_field")
    role = item.get("role")
    if role not in _ROLES:
        raise APIError(400, f"input[{i}].role must be one of {', '.join(_ROLES)}, not "
                       f"{role!r}", param=f"input[{i}].role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    return {"role": role, "content": _text(i, content, "content")}


def _text(i: int, content: Any, key: str) -> str:
    """The text of a list of text parts (``input[i].<key>``)."""
    if not isinstance(content, list):
        raise APIError(400, f"input[{i}].{key} must be a string or a list of text parts",
                       param=f"input[{i}].{key}")
    texts: list[str] = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"input[{i}].{key}[{j}]: only text parts "
                           f"({{\"type\": \"input_text\", \"text\": ...}}) are supported, "
                           f"not {kind!r}: this server serves a text model",
                           param=f"input[{i}].{key}[{j}]", code="unsupported_field")
        texts.append(part["text"])
    return "".join(texts)
