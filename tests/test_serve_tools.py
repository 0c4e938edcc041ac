"""Tool calling through the official openai client against a real server on the real
model (issue 46): ``tool_choice`` ``required`` and a named function give calls whose
arguments validate against the function's schema; streamed tool-call deltas, as the
client's stream helper reassembles them, equal the answer not streamed;
``parallel_tool_calls``; a two-turn exchange renders through the template. The Hermes
parser, whole and streamed a character at a time, agree.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from pydantic import BaseModel, Field

from phalanx.engine.core.grammar import compile_grammar
from phalanx.serve.api.tools import HermesStream, format_of, parse_hermes, render_messages
from real_model import fetch
from serve_util import Server

MODEL = "SmolLM2-135M-Instruct.Q4_1"


class Weather(BaseModel):
    city: str = Field(max_length=24)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


class Add(BaseModel):
    a: int = Field(ge=-1000, le=1000)
    b: int = Field(ge=-1000, le=1000)


def _tool(name: str, model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    schema["additionalProperties"] = False
    return {"type": "function", "function": {"name": name, "description": name.replace(
        "_", " "), "parameters": schema}}


TOOLS = [_tool("get_weather", Weather), _tool("add", Add)]
ARGS = {"get_weather": Weather, "add": Add}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server(str(fetch()), "--tp", "1", "--no-prefix-cache-disk")
    yield s
    s.stop()


def _ask(client: Any, stream: bool = False, **kwargs: Any) -> Any:
    base = {"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0,
            "max_tokens": 96, **kwargs}
    if not stream:
        return client.chat.completions.create(**base).choices[0]
    with client.chat.completions.stream(**base) as s:
        for _ in s:
            pass
        return s.get_final_completion().choices[0]


def _valid(choice: Any) -> list[tuple[str, dict[str, Any]]]:
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls, choice.message
    out = []
    for c in calls:
        assert c.type == "function" and c.id
        ARGS[c.function.name].model_validate_json(c.function.arguments)
        out.append((c.function.name, json.loads(c.function.arguments)))
    return out


def test_required_and_named_calls_validate_and_streams_reassemble(server: Server) -> None:
    client = server.openai()
    named = {"type": "function", "function": {"name": "add"}}
    one = {"parallel_tool_calls": False}
    forms = [{"tool_choice": "required", **one}, {"tool_choice": named, **one},
             {"tool_choice": "required"}]
    calls = [lambda f=f, st=st: _ask(client, st, **f) for f in forms for st in (False, True)]
    with ThreadPoolExecutor(len(calls)) as pool:
        out = list(pool.map(lambda f: f(), calls))
    for plain, streamed in zip(out[:4:2], out[1:4:2], strict=True):
        assert _valid(plain) == _valid(streamed)      # temperature 0: the same call
        assert len(_valid(plain)) == 1                # parallel_tool_calls=false: one
    assert all(name == "add" for name, _ in _valid(out[2]))
    # parallel: one or more calls, each valid (how many is the model's choice, and
    # where it stops may differ between batch positions at temperature 0)
    assert _valid(out[4]) and _valid(out[5])


def test_auto_lets_the_model_answer_and_none_parses_nothing(server: Server) -> None:
    client = server.openai()
    choice = _ask(client, tool_choice="none")
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    choice = _ask(client)                             # auto: a valid call, or text
    if choice.message.tool_calls:
        _valid(choice)


def test_a_two_turn_exchange_renders_through_the_template(server: Server) -> None:
    client = server.openai()
    first = _ask(client, parallel_tool_calls=False, tool_choice={
        "type": "function", "function": {"name": "get_weather"}})
    (call,) = first.message.tool_calls
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                            temperature=0, max_tokens=24)
    assert second.choices[0].message.content
    rendered, extra = render_messages(messages, TOOLS, "{{ messages }}")
    text = json.dumps(rendered)
    assert extra == {} and "<tools>" in rendered[0]["content"]
    assert "<tool_call>" in text and "<tool_response>\\n18 degrees, sunny" in text


def test_bad_tools_are_400s_naming_the_field(server: Server) -> None:
    client = server.openai()
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        _ask(client, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
        client.chat.completions.create(model=MODEL, messages=ASK, tool_choice="required")


def _replay(deltas: list[dict[str, Any]]) -> tuple[str, list[tuple[str, str]], int]:
    """Content, (name, arguments) per call, and argument fragments, as a client sums them."""
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, list[str]] = {}
    fragments = 0
    for d in deltas:
        for c in d.get("tool_calls", []):
            if "id" in c:
                assert c["index"] not in calls and c["function"]["arguments"] == ""
                calls[c["index"]] = [c["function"]["name"], ""]
            else:
                calls[c["index"]][1] += c["function"]["arguments"]
                fragments += 1
    return content, [(n, a) for n, a in (calls[i] for i in sorted(calls))], fragments


def test_the_hermes_stream_parser_agrees_with_the_whole_parse() -> None:
    text = ('Let me check.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
            '</tool_call>\n<tool_call>\n{"arguments": {"city": "X"}, "name": "get_weather"}'
            '\n</tool_call> <tool_ca')
    content, calls = parse_hermes(text)
    stream = HermesStream()
    got, streamed, fragments = _replay([d for ch in text for d in stream.feed(ch)]
                                       + stream.finish())
    assert got.split() == (content or "").split()
    assert streamed == [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert [json.loads(a) for _, a in streamed] == [{"a": 1, "b": 2}, {"city": "X"}]
    assert fragments > 5        # the first call's arguments went out as they came


@pytest.mark.parametrize(("template", "name", "text", "want_content", "want"), [
    ("{{ '<tool_call>' }}", "hermes",
     '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', None,
     [("add", {"a": 1})]),
    ("{% if tools %}<|python_tag|>{% endif %}", "llama3_json",
     '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "add", '
     '"parameters": {"a": 2}}', None, [("add", {"a": 1}), ("add", {"a": 2})]),
    ("{% if tools %}ipython{% endif %}", "llama3_json", "The answer is 3.",
     "The answer is 3.", []),
    ("[TOOL_CALLS]{{ tools }}", "mistral",
     'ok [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}]', "ok", [("add", {"a": 1})]),
    ("[TOOL_CALLS]{{ tools }}", "mistral",
     '[TOOL_CALLS]add[ARGS]{"a": 5}', None, [("add", {"a": 5})]),
    ("{{ messages }}", "hermes", "plain text", "plain text", []),
])
def test_each_format_parses_whole_and_streamed(template: str, name: str, text: str,
                                               want_content: str | None,
                                               want: list[tuple[str, Any]]) -> None:
    fmt = format_of(template)
    assert name == fmt.NAME
    content, calls = fmt.parse(text)
    assert content == want_content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in calls] == want
    stream = fmt.stream()
    got, streamed, _ = _replay([d for ch in text for d in stream.feed(ch)] + stream.finish())
    assert [(n, json.loads(a)) for n, a in streamed] == want
    assert got.split() == (want_content or "").split() or not want
    # the grammar that forces this format's calls compiles, once and in parallel
    fns = [t["function"] for t in TOOLS]
    for parallel in (False, True):
        compile_grammar("grammar", fmt.grammar(fns, parallel))
