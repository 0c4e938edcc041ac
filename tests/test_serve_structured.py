"""Structured outputs and tool calls through the official openai client against a real
server on the real model (issue 46): ``chat.completions.parse`` with pydantic models
(nested objects, bounded arrays, enums, ranged numbers, optional and nullable fields,
anyOf), streamed and not, at TP 1 and TP 3; ``json_object``, vLLM's ``regex`` and
``choice``; a schema the grammar engine refuses is a 400 naming the part; a JSON cut by
``max_tokens`` ends with ``length``. Tool calls (at TP 1): ``tool_choice`` ``required``
and a named function give calls whose arguments validate against the function's schema;
streamed tool-call deltas, as the client's stream helper reassembles them, equal the
answer not streamed; ``parallel_tool_calls``; a two-turn exchange renders through the
template. One server per TP size; the requests of a test are fired at once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from phalanx.serve.api.tools import render_messages
from real_model import fetch
from serve_util import Server

MODEL = "SmolLM2-135M-Instruct.Q4_1"
Short = Field(max_length=24)


class Person(BaseModel):
    name: str = Short
    age: int = Field(ge=0, le=120)


class Address(BaseModel):
    city: str = Short
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Customer(BaseModel):
    name: str = Short
    address: Address


class Tags(BaseModel):
    tags: list[str] = Field(min_length=1, max_length=3)


class Color(StrEnum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Paint(BaseModel):
    color: Color
    shades: list[Color] = Field(min_length=1, max_length=2)


class Weather(BaseModel):
    celsius: float = Field(ge=-50, le=50)
    humidity: int = Field(ge=0, le=100)


class Profile(BaseModel):
    name: str = Short
    nickname: str | None = None          # optional
    middle_name: str | None              # nullable, required


class Reading(BaseModel):
    value: int | str                     # anyOf
    unit: Literal["m", "kg", "s"]


class Item(BaseModel):
    name: str = Short
    qty: int = Field(ge=1, le=10)


class Order(BaseModel):
    items: list[Item] = Field(min_length=1, max_length=3)
    paid: bool


class Verdict(BaseModel):
    ok: bool
    score: float = Field(ge=0, le=1)
    reason: Literal["clear", "unclear"]


CASES: list[tuple[type[BaseModel], str]] = [
    (Person, "Describe a person named Alice who is 30."),
    (Customer, "A customer, Bob, living in Paris, zip 75001."),
    (Tags, "Give tags for a blog post about cooking."),
    (Paint, "Pick a paint color and shades."),
    (Weather, "Weather in Rome today."),
    (Profile, "A profile for John."),
    (Reading, "A measurement of 5 kilograms."),
    (Order, "An order of two apples, paid."),
    (Verdict, "Is the sky blue? Give a verdict."),
    (Item, "One item: three pens."),
]


@pytest.fixture(scope="module", params=[1, pytest.param(3, marks=pytest.mark.slow)],
                ids=["tp1", "tp3"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    s = Server(str(fetch()), "--tp", str(request.param), "--no-prefix-cache-disk")
    yield s
    s.stop()


def _messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Answer in JSON."},
            {"role": "user", "content": prompt}]


def _choice(client: Any, stream: bool, kwargs: dict[str, Any]) -> Any:
    """The first choice of a chat completion, non-streamed (parsed against its
    ``response_format``, if any) or streamed (the client's stream helper reassembles the
    deltas)."""
    if not stream:
        done = (client.chat.completions.parse if "response_format" in kwargs
                else client.chat.completions.create)
        return done(**kwargs).choices[0]
    with client.chat.completions.stream(**kwargs) as s:
        for _ in s:
            pass
        return s.get_final_completion().choices[0]


def _parse(client: Any, model: type[BaseModel], prompt: str, stream: bool) -> Any:
    return _choice(client, stream, {"model": MODEL, "messages": _messages(prompt),
                                    "response_format": model, "temperature": 0,
                                    "max_tokens": 160})


def _all(calls: list[Callable[[], Any]]) -> list[Any]:
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda f: f(), calls))


def test_parse_validates_for_every_schema_streamed_and_not(server: Server) -> None:
    client = server.openai()
    calls = [lambda m=m, p=p, st=st: _parse(client, m, p, st)
             for m, p in CASES for st in (False, True)]
    for (model, _), choice in zip([c for c in CASES for _ in (0, 1)], _all(calls),
                                  strict=True):
        assert choice.finish_reason == "stop", (model.__name__, choice.message.content)
        parsed = choice.message.parsed
        assert isinstance(parsed, model), (model.__name__, choice.message.content)
        model.model_validate_json(choice.message.content)


def _create(client: Any, stream: bool, **kwargs: Any) -> tuple[str, str | None]:
    base = {"model": MODEL, "temperature": 0, "max_tokens": 64, **kwargs}
    if not stream:
        r = client.chat.completions.create(**base)
        return r.choices[0].message.content or "", r.choices[0].finish_reason
    text, finish = [], None
    for chunk in client.chat.completions.create(**base, stream=True):
        for c in chunk.choices:
            text.append(c.delta.content or "")
            finish = c.finish_reason or finish
    return "".join(text), finish


def test_json_object_regex_and_choice(server: Server) -> None:
    client = server.openai()
    ask = _messages('The weather in Paris as {"city": ..., "sky": ...}, one word each.')
    regex = r"[0-9]{3}-[a-z]{2,6}"
    choices = ["sunny", "rainy", "cloudy"]
    forms: list[dict[str, Any]] = [
        {"response_format": {"type": "json_object"}},
        {"extra_body": {"structured_outputs": {"regex": regex}}},
        {"extra_body": {"structured_outputs": {"choice": choices}}},
    ]
    calls = [lambda f=f, st=st: _create(client, st, messages=ask, **f)
             for f in forms for st in (False, True)]
    out = _all(calls)
    for (text, finish) in out[0:2]:
        assert finish == "stop" and isinstance(json.loads(text), dict), text
    for (text, finish) in out[2:4]:
        assert finish == "stop" and re.fullmatch(regex, text), text
    for (text, finish) in out[4:6]:
        assert finish == "stop" and text in choices, text
    # completions take the same constraint
    r = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=8,
                                  temperature=0,
                                  extra_body={"structured_outputs": {"choice": choices}})
    assert r.choices[0].text in choices


def test_a_schema_that_cannot_compile_is_a_400_naming_the_part(server: Server) -> None:
    client = server.openai()
    bad = {"type": "object", "properties": {
        "ok": {"type": "string"},
        "age": {"type": "object", "properties": {"n": {"type": "frobnicate"}}}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=_messages("x"), max_tokens=4,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "bad", "schema": bad}})
    err = info.value.body
    assert isinstance(err, dict) and err["param"] == "response_format.json_schema.schema"
    assert "properties.age.properties.n" in err["message"], err["message"]
    assert "frobnicate" in err["message"]
    with pytest.raises(openai.BadRequestError, match=r"structured_outputs\.regex"):
        client.chat.completions.create(
            model=MODEL, messages=_messages("x"), max_tokens=4,
            extra_body={"structured_outputs": {"regex": "(unclosed"}})
    with pytest.raises(openai.BadRequestError, match="one structured-output constraint"):
        client.chat.completions.create(
            model=MODEL, messages=_messages("x"), max_tokens=4,
            response_format={"type": "json_object"},
            extra_body={"structured_outputs": {"choice": ["a"]}})


def test_a_json_cut_by_max_tokens_ends_with_length(server: Server) -> None:
    client = server.openai()
    text, finish = _create(client, False, messages=_messages("A person."), max_tokens=5,
                           response_format={"type": "json_schema", "json_schema": {
                               "name": "p", "schema": Person.model_json_schema()}})
    assert finish == "length" and text.startswith("{")
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(model=MODEL, messages=_messages("A person."),
                                      response_format=Person, max_tokens=5)


# -- tool calls --------------------------------------------------------------------

class WeatherArgs(BaseModel):
    city: str = Short
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


class AddArgs(BaseModel):
    a: int = Field(ge=-1000, le=1000)
    b: int = Field(ge=-1000, le=1000)


def _tool(name: str, model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    schema["additionalProperties"] = False
    return {"type": "function", "function": {"name": name, "description": name.replace(
        "_", " "), "parameters": schema}}


TOOLS = [_tool("get_weather", WeatherArgs), _tool("add", AddArgs)]
ARGS = {"get_weather": WeatherArgs, "add": AddArgs}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture
def tp1(server: Server, request: pytest.FixtureRequest) -> Server:
    """The module's server at TP 1 (tool calls are checked there; the grammar's masks at
    TP 3 by the schemas above)."""
    if request.node.callspec.params.get("server") != 1:
        pytest.skip("tool calls are checked at TP 1")
    return server


def _ask(client: Any, stream: bool = False, **kwargs: Any) -> Any:
    return _choice(client, stream, {"model": MODEL, "messages": ASK, "tools": TOOLS,
                                    "temperature": 0, "max_tokens": 96, **kwargs})


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


def test_required_and_named_calls_validate_and_streams_reassemble(tp1: Server) -> None:
    client = tp1.openai()
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


def test_auto_lets_the_model_answer_and_none_parses_nothing(tp1: Server) -> None:
    client = tp1.openai()
    choice = _ask(client, tool_choice="none")
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    for stream in (False, True):                      # auto: text, or valid calls
        choice = _ask(client, stream)
        if choice.message.tool_calls:
            _valid(choice)


def test_a_two_turn_exchange_renders_through_the_template(tp1: Server) -> None:
    client = tp1.openai()
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


def test_bad_tools_are_400s_naming_the_field(tp1: Server) -> None:
    client = tp1.openai()
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        _ask(client, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
        client.chat.completions.create(model=MODEL, messages=ASK, tool_choice="required")
