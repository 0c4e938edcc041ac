"""The OpenAI API as applications use it (issue 46): no request field is ignored
silently, ``n`` > 1 shares one prefill, and ``POST /v1/responses``.

The field table (``phalanx.serve.api.fields``) is checked against the installed
``openai`` package's own TypedDicts, so a field a new openai release adds fails here
until it is classified. Every refused field, sent with a value that asks for something,
is a 400 naming it: validation runs before admission, so these cost no generation.

One server (TP 1, the embedded model, memory tier only) answers them all.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from phalanx.serve.api import fields as F
from phalanx.serve.api.protocol import ChatCompletionRequest, CompletionRequest
from phalanx.serve.api.responses_protocol import ResponsesRequest
from serve_util import Server, model_env, pages_prompt

PAGE = 64  # the engine's page_tokens: the prefix cache's unit


def _openai_fields(module: Any, base: str, streaming: str) -> set[str]:
    """A request's fields as the installed openai package types them."""
    return set(typing.get_type_hints(getattr(module, base))) | set(
        typing.get_type_hints(getattr(module, streaming)))


def _tables() -> list[tuple[F.Fields, set[str]]]:
    from openai.types import completion_create_params as completion
    from openai.types.chat import completion_create_params as chat
    from openai.types.responses import response_create_params as responses
    return [
        (F.CHAT, _openai_fields(chat, "CompletionCreateParamsBase",
                                "CompletionCreateParamsStreaming")),
        (F.COMPLETIONS, _openai_fields(completion, "CompletionCreateParamsBase",
                                       "CompletionCreateParamsStreaming")),
        (F.RESPONSES, _openai_fields(responses, "ResponseCreateParamsBase",
                                     "ResponseCreateParamsStreaming")),
    ]


@pytest.mark.parametrize("table", _tables(), ids=lambda t: t[0].endpoint)
def test_every_openai_field_is_honoured_refused_or_informational(
        table: tuple[F.Fields, set[str]]) -> None:
    fields, theirs = table
    kinds = [fields.honoured, fields.informational, set(fields.refused)]
    assert theirs == set().union(*kinds), (
        f"{fields.endpoint}: not classified {sorted(theirs - set().union(*kinds))}, "
        f"not OpenAI's {sorted(set().union(*kinds) - theirs)}")
    for i, a in enumerate(kinds):
        for b in kinds[i + 1:]:
            assert not a & b, f"{fields.endpoint}: in two kinds: {sorted(a & b)}"
    assert not fields.extensions & theirs


@pytest.mark.parametrize(("kind", "fields"), [(ChatCompletionRequest, F.CHAT),
                                              (CompletionRequest, F.COMPLETIONS),
                                              (ResponsesRequest, F.RESPONSES)])
def test_the_request_structs_declare_every_field_of_their_table(
        kind: type, fields: F.Fields) -> None:
    declared = set(kind.__struct_fields__)
    table = fields.honoured | fields.informational | set(fields.refused) | fields.extensions
    assert declared == table


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("fields-home")
    s = Server("--tp", "1", "--no-prefix-cache-disk", "--max-num-seqs", "4",
               "--max-waiting", "4", env=model_env(home))
    yield s
    assert s.stop() == 0


def _client(s: Server) -> openai.OpenAI:
    c: openai.OpenAI = s.openai()
    return c


# a value that asks for something, per refused field (the default: an object)
_ASKS: dict[str, Any] = {"frequency_penalty": 0.5, "presence_penalty": -0.5, "store": True,
                         "echo": True, "best_of": 2, "suffix": "end", "background": True,
                         "top_logprobs": 2, "truncation": "auto", "modalities": ["audio"],
                         "tool_choice": "required", "parallel_tool_calls": True,
                         "reasoning_effort": "high", "verbosity": "low",
                         "prompt_cache_retention": "24h", "include": ["x"],
                         "previous_response_id": "resp_1", "max_tool_calls": 2,
                         "tools": [{"type": "function", "function": {"name": "f"}}]}


def _create(s: Server, fields: F.Fields, **extra: Any) -> Any:
    c, model = _client(s), _model(s)
    if fields is F.CHAT:
        return c.chat.completions.create(model=model, max_tokens=2, extra_body=extra,
                                         messages=[{"role": "user", "content": "hi"}])
    if fields is F.COMPLETIONS:
        return c.completions.create(model=model, prompt="hi", max_tokens=2,
                                    extra_body=extra)
    return c.responses.create(model=model, input="hi", max_output_tokens=2,
                              extra_body=extra)


_ENDPOINTS = [F.CHAT, F.COMPLETIONS, F.RESPONSES]


def _refused() -> list[Any]:
    return [pytest.param(f, name, id=f"{f.endpoint}-{name}")
            for f in _ENDPOINTS for name in sorted(f.refused)]


def _model(s: Server) -> str:
    return str(s.client.get("/v1/models").json()["data"][0]["id"])


@pytest.mark.parametrize(("fields", "name"), _refused())
def test_a_refused_field_is_a_400_naming_it(server: Server, fields: F.Fields,
                                            name: str) -> None:
    value = _ASKS.get(name, {"requested": True})
    with pytest.raises(openai.BadRequestError) as err:
        _create(server, fields, **{name: value})
    assert err.value.param == name and err.value.code == "unsupported_field"
    assert name in err.value.message


@pytest.mark.parametrize("fields", _ENDPOINTS, ids=lambda f: f.endpoint)
def test_an_unknown_field_is_a_400_and_informational_ones_are_accepted(
        server: Server, fields: F.Fields) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        _create(server, fields, best_off=2)
    assert err.value.param == "best_off" and err.value.code == "unknown_field"
    info = {name: {"k": "v"} if name == "metadata" else "x" for name in fields.informational}
    neutral = {name: rule.neutral[-1] for name, rule in fields.refused.items()}
    assert _create(server, fields, **info, **neutral) is not None


def test_a_messages_keys_are_openais_or_a_400_naming_the_key(server: Server) -> None:
    """A message's own keys follow the rule of the request's: an answer echoed back
    (what the openai client sends of a ChatCompletionMessage) is accepted; an unknown
    key, and audio or function_call set, are 400s naming messages[i].key."""
    c, model = _client(server), _model(server)
    first = c.chat.completions.create(model=model, max_tokens=3,
                                      messages=[{"role": "user", "content": "hi"}])
    echoed = first.choices[0].message.model_dump()   # refusal, annotations, audio: None
    assert {"refusal", "audio", "function_call"} <= set(echoed)
    again = c.chat.completions.create(model=model, max_tokens=3, messages=[
        {"role": "user", "content": "hi"}, echoed, {"role": "user", "content": "and?"}])
    assert again.choices[0].finish_reason == "length"
    bad: list[tuple[dict[str, Any], str, str]] = [
        ({"role": "user", "content": "hi", "weight": 2}, "messages[0].weight",
         "unknown_field"),
        ({"role": "assistant", "content": "", "audio": {"id": "a1"}}, "messages[0].audio",
         "unsupported_field"),
        ({"role": "assistant", "content": None,
          "function_call": {"name": "f", "arguments": "{}"}},
         "messages[0].function_call", "unsupported_field")]
    for message, param, code in bad:
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model=model, max_tokens=2, messages=[
                message, {"role": "user", "content": "hi"}])  # type: ignore[list-item]
        assert (err.value.param, err.value.code) == (param, code), message


def _prompt(words: int, seed: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": pages_prompt(words, seed)}]


def _tail(prompt_tokens: int) -> int:
    """The most a later choice computes itself: the prompt past its last full page
    before the token sampled from (the first choice's partial page is still being
    written, so it is no copy source; a finished request's page that starts the same
    way may be: then it computes less, never less than the token it samples from)."""
    return prompt_tokens - (prompt_tokens - 1) // PAGE * PAGE


def _one_prefill(usage: Any, later: int) -> None:
    """``usage`` counts the prompt's computation once, and ``later`` choices' tails."""
    computed = (usage.model_extra or {})["prompt_tokens_computed"]
    assert usage.prompt_tokens + later <= computed
    assert computed <= usage.prompt_tokens + later * _tail(usage.prompt_tokens)


def test_n_choices_share_one_prefill(server: Server) -> None:
    before = server.metric("phalanx:prompt_tokens_computed_total")
    hits = server.metric("phalanx:prefix_cache_hits_memory_total")
    r = _client(server).chat.completions.create(
        model=_model(server), messages=_prompt(120, 1), n=4, temperature=0.8, max_tokens=6)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    usage = r.usage
    assert usage is not None and usage.prompt_tokens > 2 * PAGE
    # the prompt counted once; the 3 later choices computed only their tails
    _one_prefill(usage, 3)
    once = (usage.model_extra or {})["prompt_tokens_computed"]
    assert server.metric("phalanx:prompt_tokens_computed_total") - before == once
    # ... and found the rest in memory (the first one's pages)
    assert server.metric("phalanx:prefix_cache_hits_memory_total") - hits == \
        4 * usage.prompt_tokens - once
    assert len({c.message.content for c in r.choices}) > 1  # sampled, not copies


def test_n_choices_streamed_have_their_indices_and_one_prefill(server: Server) -> None:
    stream = _client(server).chat.completions.create(
        model=_model(server), messages=_prompt(110, 2), n=3, temperature=0.8, max_tokens=5,
        stream=True, stream_options={"include_usage": True})
    texts = {0: "", 1: "", 2: ""}
    roles, finished, usage = set(), set(), None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.add(c.index)
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert roles == finished == {0, 1, 2}
    assert usage is not None
    _one_prefill(usage, 2)


def test_each_choice_samples_with_seed_plus_its_index(server: Server) -> None:
    c, model = _client(server), _model(server)
    ask = {"model": model, "prompt": "the seeds of", "temperature": 0.8, "max_tokens": 6}
    many = c.completions.create(n=3, seed=40, **ask)
    singles = [c.completions.create(seed=40 + i, **ask).choices[0].text for i in range(3)]
    assert [x.text for x in many.choices] == singles
    assert many.usage is not None and many.usage.prompt_tokens == \
        c.completions.create(seed=1, **ask).usage.prompt_tokens  # type: ignore[union-attr]


def test_completions_index_choices_by_prompt_then_choice(server: Server) -> None:
    r = _client(server).completions.create(
        model=_model(server), prompt=["one two", "three four five"], n=2, seed=7,
        temperature=0.8, max_tokens=3)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    singles = [_client(server).completions.create(
        model=_model(server), prompt=p, seed=7 + j, temperature=0.8, max_tokens=3)
        .choices[0].text for p in ("one two", "three four five") for j in range(2)]
    assert [c.text for c in r.choices] == singles


def test_n_beyond_the_admission_slots_is_refused_before_admission(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        _client(server).completions.create(model=_model(server), prompt="x", n=9)
    assert err.value.param == "n" and err.value.code == "too_many_prompts"


# -- POST /v1/responses ---------------------------------------------------------------

def _respond(s: Server, **kw: Any) -> Any:
    return _client(s).responses.create(model=_model(s), temperature=kw.pop("temperature", 0),
                                       max_output_tokens=kw.pop("max_output_tokens", 6), **kw)


def test_a_response_to_a_string_input(server: Server) -> None:
    r = _respond(server, input="Tell me about the sea")
    assert r.object == "response" and r.status == "incomplete"  # cut at 6 tokens
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and r.output[0].type == "message"
    chat = _client(server).chat.completions.create(
        model=_model(server), temperature=0, max_tokens=6,
        messages=[{"role": "user", "content": "Tell me about the sea"}])
    assert r.output_text == chat.choices[0].message.content  # the same prompt and text
    assert r.usage is not None and chat.usage is not None
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == 6 and r.usage.total_tokens == r.usage.input_tokens + 6
    assert r.usage.input_tokens_details.cached_tokens >= 0
    assert r.usage.output_tokens_details.reasoning_tokens == 0


def test_items_and_instructions_are_the_chat_messages(server: Server) -> None:
    items: list[Any] = [
        {"role": "user", "content": "Hello there"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Hi!"}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "And "},
                     {"type": "input_text", "text": "then?"}]}]
    r = _respond(server, input=items, instructions="Be brief.")
    chat = _client(server).chat.completions.create(
        model=_model(server), temperature=0, max_tokens=6, messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": "Hi!"},
            {"role": "user", "content": "And then?"}])
    assert r.output_text == chat.choices[0].message.content
    assert r.instructions == "Be brief."


def test_an_items_keys_are_its_types_or_a_400_naming_the_key(server: Server) -> None:
    """An earlier answer's output items sent back as input (the way the openai docs
    continue a stateless conversation) are accepted; a key no item of its type has, in
    an item or a function tool, is a 400 naming input[i].key / tools[i].key."""
    first = _respond(server, input="Hello there")
    echoed = [item.model_dump(exclude_none=True) for item in first.output]
    assert {"id", "status"} <= set(echoed[0])
    again = _respond(server, input=[{"role": "user", "content": "Hello there"}, *echoed,
                                    {"role": "user", "content": "And then?"}])
    assert again.output_text
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    for kw, param in [
            ({"input": [{"role": "user", "content": "hi", "weight": 2}]}, "input[0].weight"),
            ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1",
                         "extra": True}]}, "input[0].extra"),
            ({"input": "hi", "tools": [{**tool, "cache": True}]}, "tools[0].cache")]:
        with pytest.raises(openai.BadRequestError) as err:
            _respond(server, **kw)
        assert (err.value.param, err.value.code) == (param, "unknown_field"), kw


def test_streamed_events_are_parsed_by_the_client_and_equal_the_answer(
        server: Server) -> None:
    whole = _respond(server, input="Count to ten")
    kinds: list[str] = []
    text = ""
    final = None
    for event in _respond(server, input="Count to ten", stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert final is not None and final.output_text == text == whole.output_text
    assert final.usage is not None and final.usage.output_tokens == 6


CHOICE = {"type": "object", "properties": {"pick": {"enum": ["red", "green", "blue"]}},
          "required": ["pick"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_text_format_json_schema_is_enforced(server: Server, stream: bool) -> None:
    fmt = {"type": "json_schema", "name": "choice", "schema": CHOICE, "strict": True}
    if stream:
        with _client(server).responses.stream(model=_model(server), input="Pick a colour",
                                              text={"format": fmt},  # type: ignore[typeddict-item]
                                              temperature=0,
                                              max_output_tokens=40) as events:
            r = events.get_final_response()
    else:
        r = _respond(server, input="Pick a colour", text={"format": fmt}, max_output_tokens=40)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    assert json.loads(r.output_text)["pick"] in ("red", "green", "blue")
    free = _respond(server, input="Pick a colour", max_output_tokens=40)
    assert free.output_text != r.output_text  # (free text is not that)


def test_the_stream_helper_accumulates_the_answer(server: Server) -> None:
    """``client.responses.stream``: its snapshot of the text equals the deltas."""
    deltas, snapshot = "", ""
    with _client(server).responses.stream(model=_model(server), input="Say hello",
                                          temperature=0, max_output_tokens=6) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas += event.delta
                snapshot = event.snapshot
    assert deltas and snapshot == deltas


@pytest.mark.parametrize(("extra", "param"), [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"text": {"format": {"type": "json_schema", "name": "bad", "schema": {
        "type": "object", "properties": {"n": {"type": "frobnicate"}}}}}},
     "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "strictly": 1}}},
     "text.format.strictly"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]},
     "tools[0].parameters"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0]"),
])
def test_what_a_stateless_text_server_cannot_do_is_a_400_naming_it(
        server: Server, extra: dict[str, Any], param: str) -> None:
    body = {"input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as err:
        _client(server).responses.create(model=_model(server), **body)
    assert err.value.param == param


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Rome"]}},
               "required": ["city"], "additionalProperties": False}}


def test_a_forced_function_call_is_an_item_whose_arguments_validate(server: Server) -> None:
    # one call (parallel calls let the random embedded model write whitespace for more
    # until the limit)
    r = _respond(server, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                 parallel_tool_calls=False, max_output_tokens=60)
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and len(calls) >= 1
    assert calls[0].name == "get_weather" and calls[0].call_id
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")
    named = _respond(server, input="Weather?", tools=[WEATHER], parallel_tool_calls=False,
                     tool_choice={"type": "function", "name": "get_weather"},
                     max_output_tokens=60)
    assert [i.type for i in named.output] == ["function_call"]


def test_streamed_function_call_events_reassemble_the_answer(server: Server) -> None:
    ask: dict[str, Any] = {"input": "Weather in Rome?", "tools": [WEATHER],
                           "tool_choice": "required", "parallel_tool_calls": False,
                           "max_output_tokens": 60}
    whole = _respond(server, **ask)
    args, kinds = "", []
    with _client(server).responses.stream(model=_model(server), temperature=0,
                                          **ask) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.function_call_arguments.delta":
                args += event.delta
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    (call,) = [i for i in final.output if i.type == "function_call"]
    (expected,) = [i for i in whole.output if i.type == "function_call"]
    assert call.arguments == args == expected.arguments and call.name == expected.name


def test_function_call_items_and_their_outputs_are_the_chat_tool_turns(
        server: Server) -> None:
    items: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": "{\"city\": \"Paris\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]
    r = _respond(server, input=items, tools=[WEATHER], tool_choice="none")
    chat = _client(server).chat.completions.create(
        model=_model(server), temperature=0, max_tokens=6, tool_choice="none",
        tools=[{"type": "function", "function": {
            k: WEATHER[k] for k in ("name", "description", "parameters")}}],
        messages=[{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "", "tool_calls": [{
                      "id": "call_1", "type": "function", "function": {
                          "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage is not None and chat.usage is not None
    assert r.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_malformed_tool_call_in_a_message_is_a_400(server: Server, path: str) -> None:
    """The fuzzer's ``"tool_calls": [{}]`` was a 500 (KeyError in the renderer)."""
    r = server.client.post(path, json={"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{}]}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[1].tool_calls[0]"


def test_a_response_without_input_is_a_400_naming_it(server: Server) -> None:
    r = server.client.post("/v1/responses", json={"instructions": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
