"""Request bodies of the OpenAI-compatible API, decoded and validated by msgspec.

Fields follow OpenAI's order and names, plus the extensions vLLM's server accepts
(``top_k``, ``stop_token_ids``, ``ignore_eos``). No field is ignored silently (issue
46): each of OpenAI's is honoured, informational or refused (``fields.py`` holds the
table and says why), and a field nobody declares is a 400 naming it. A wrong type or an
out-of-range value is a 400 naming the field.

Every number is bounded here, where it enters (issue 45): a value that passed these
structs can be encoded into a step plan (msgpack: 64-bit integers) and computed with,
so no client value can fail the engine's own step code. ``seed`` is a signed 64-bit
integer (as vLLM and torch take it), token ids and counts fit 31 bits.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import msgspec

from phalanx.engine.core.sampling import MAX_LOGPROBS, SEED_RANGE, TOP_K_MAX

from .errors import APIError
from .fields import CHAT, COMPLETIONS, Fields, check_refused, unknown_field

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "JsonSchemaSpec",
    "ResponseFormat",
    "StreamOptions",
    "StructuredOutputs",
    "TokenizeRequest",
    "decode_request",
]


T = TypeVar("T", bound=msgspec.Struct)

# the engine's own bounds (what a step plan can carry), applied where values enter
INT31 = TOP_K_MAX          # token ids, counts and top_k: far beyond any vocabulary
SEED_MIN, SEED_MAX = SEED_RANGE

Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, msgspec.Meta(ge=-1, le=INT31)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1, le=INT31)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=INT31)]
Seed = Annotated[int, msgspec.Meta(ge=SEED_MIN, le=SEED_MAX)]
LogprobCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)]


class StreamOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # informational: no obfuscation is added


class JsonSchemaSpec(msgspec.Struct, frozen=True, kw_only=True):
    """``response_format.json_schema`` (OpenAI): the schema the output must match."""

    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, frozen=True, kw_only=True):
    """``response_format``: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs``: exactly one constraint (``serve/api/structured.py``)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The fields completions and chat share (``fields.py``: what each does here)."""

    FIELDS: ClassVar[Fields]

    model: str | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: Any = None
    max_tokens: PositiveInt | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=128)] = 1
    presence_penalty: Penalty | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    user: str | None = None
    # vLLM's extensions.
    top_k: TopK = -1
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    # structured outputs (issue 46): vLLM's extension; OpenAI's response_format below
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None

    def check_common(self) -> None:
        check_refused(self, self.FIELDS)
        if self.seed is not None and self.seed + self.n - 1 > SEED_MAX:
            # choice i is sampled with seed + i (vLLM's rule): each must be a seed
            raise APIError(400, f"seed={self.seed} with n={self.n}: choice i samples with "
                           f"seed + i, which must stay <= {SEED_MAX}", param="seed")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not s for s in stops):
            raise APIError(400, "stop strings must be non-empty", param="stop")
        if len(stops) > 16:
            raise APIError(400, f"at most 16 stop strings, got {len(stops)}", param="stop")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true",
                           param="stream_options")


class CompletionRequest(_Sampling, frozen=True, kw_only=True):
    """``POST /v1/completions``: a prompt as a string, a list of strings, or token ids."""

    # str | list[str] | list[int] | list[list[int]]; msgspec takes one array type in a
    # union, so the list's items are a union and check() requires them homogeneous.
    FIELDS: ClassVar[Fields] = COMPLETIONS

    prompt: str | list[str | TokenId | list[TokenId]]
    best_of: Any = None
    echo: Any = None
    logprobs: LogprobCount | None = None
    suffix: Any = None

    def check(self) -> None:
        self.check_common()
        for prompt in self.prompts():
            if len(prompt) == 0:
                raise APIError(400, "the prompt is empty: send at least one token or "
                               "character", param="prompt")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: strings or token id lists (one choice each)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return [[]]
        if all(isinstance(x, int) for x in p):
            return [[int(x) for x in p]]  # type: ignore[arg-type]
        if all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
            return list(p)  # type: ignore[arg-type]
        raise APIError(400, "prompt must be a string, a list of strings, a list of token "
                       "ids or a list of token id lists, not a mix", param="prompt")


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One message of a chat request: OpenAI's keys of every role, and no other (an
    unknown key is a 400 naming ``messages[i].key``, never dropped in silence).

    An assistant message echoed back from an earlier answer carries ``refusal``,
    ``annotations``, ``audio`` and ``function_call`` (the openai client sends what it
    received): ``refusal`` and ``annotations`` describe that answer and change nothing
    the model reads; ``audio`` and the deprecated ``function_call`` are refused when set
    (:meth:`check_calls`)."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, object]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None   # an assistant's calls (issue 46)
    tool_call_id: str | None = None                  # a tool result's call
    refusal: str | None = None                       # informational (see above)
    annotations: list[dict[str, Any]] | None = None  # informational
    audio: dict[str, Any] | None = None              # refused when set
    function_call: dict[str, Any] | None = None      # refused when set: send tool_calls

    def check_calls(self, index: int) -> None:
        """Each of ``tool_calls`` is ``{"id", "type": "function", "function": {"name",
        "arguments"}}``: the template and the renderer read them (the fuzzer's
        ``"tool_calls": [{}]`` was a 500)."""
        if self.audio is not None:
            raise APIError(400, f"messages[{index}].audio is not supported: this server "
                           "serves text models; send the message's text as content",
                           param=f"messages[{index}].audio", code="unsupported_field")
        if self.function_call is not None:
            raise APIError(400, f"messages[{index}].function_call is the deprecated form "
                           "of a call: send it as tool_calls", param=f"messages[{index}]"
                           ".function_call", code="unsupported_field")
        for j, call in enumerate(self.tool_calls or []):
            fn = call.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                    or not isinstance(fn.get("arguments", ""), str | dict) \
                    or not isinstance(call.get("id", ""), str):
                raise APIError(400, f"messages[{index}].tool_calls[{j}] is {{\"id\": ..., "
                               f"\"type\": \"function\", \"function\": {{\"name\": ..., "
                               f"\"arguments\": \"...\"}}}}",
                               param=f"messages[{index}].tool_calls[{j}]")

    def text(self, index: int) -> str:
        """The message's text: a string, or the ``text`` parts of a content list."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts: list[str] = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"messages[{index}].content[{j}]: only text parts "
                               f"({{\"type\": \"text\", \"text\": ...}}) are supported",
                               param=f"messages[{index}].content")
            parts.append(str(part["text"]))
        return "".join(parts)


class ChatCompletionRequest(_Sampling, frozen=True, kw_only=True):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    FIELDS: ClassVar[Fields] = CHAT

    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: LogprobCount | None = None
    max_completion_tokens: PositiveInt | None = None
    # refused unless null or neutral, informational: fields.py says why
    audio: Any = None
    function_call: Any = None
    functions: Any = None
    metadata: Any = None
    modalities: Any = None
    moderation: Any = None
    parallel_tool_calls: Any = None
    prediction: Any = None
    prompt_cache_key: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    reasoning_effort: Any = None
    safety_identifier: Any = None
    service_tier: Any = None
    store: Any = None
    tool_choice: Any = None
    tools: Any = None
    verbosity: Any = None
    web_search_options: Any = None

    def check(self) -> None:
        self.check_common()
        if not self.messages:
            raise APIError(400, "messages is empty: send at least one message",
                           param="messages")
        for i, m in enumerate(self.messages):
            m.check_calls(i)
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


class TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /tokenize``: a prompt, or chat messages through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "send exactly one of prompt and messages", param="prompt")
        for i, m in enumerate(self.messages or []):
            m.check_calls(i)


class DetokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /detokenize``: token ids back to text."""

    tokens: list[TokenId]
    model: str | None = None


_AT = re.compile(r" - at `\$\.?([^`]*)`$")
_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`")
_MISSING = re.compile(r"Object missing required field `([^`]*)`")


def decode_request(body: bytes, kind: type[T]) -> T:
    """Decode and validate ``body`` as ``kind``; a 400 in OpenAI's shape if it is not."""
    if not body.strip():
        raise APIError(400, "the request body is empty: send a JSON object")
    try:
        request = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = _AT.search(message)
        path = match.group(1) if match else ""
        unknown = _UNKNOWN.match(message)
        if unknown:
            raise unknown_field(unknown.group(1), path,
                                getattr(kind, "FIELDS", None)) from None
        missing = _MISSING.match(message)
        if missing:  # name the field itself, not the object that lacks it
            path = f"{path}.{missing.group(1)}" if path else missing.group(1)
        raise APIError(400, f"invalid request: {message}", param=path or None) from None
    except msgspec.DecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec's own depth guard (issue 45: 200,000 '[' were a 500)
        raise APIError(400, "the request body is nested too deeply: JSON arrays and "
                       "objects may nest fewer than 1,000 levels deep") from None
    check = getattr(request, "check", None)
    if check is not None:
        check()
    return request
