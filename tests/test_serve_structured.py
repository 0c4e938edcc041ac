"""Structured outputs through the official openai client against a real server on the
real model (issue 46): ``chat.completions.parse`` with pydantic models (nested objects,
bounded arrays, enums, ranged numbers, optional and nullable fields, anyOf), streamed
and not, at TP 1 and TP 3; ``json_object``, vLLM's ``regex`` and ``choice``; a schema
the grammar engine refuses is a 400 naming the part; a JSON cut by ``max_tokens`` ends
with ``length``. One server per TP size; every request of a size is fired at once.
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


def _parse(client: Any, model: type[BaseModel], prompt: str, stream: bool) -> Any:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": _messages(prompt),
                              "response_format": model, "temperature": 0, "max_tokens": 160}
    if not stream:
        return client.chat.completions.parse(**kwargs).choices[0]
    with client.chat.completions.stream(**kwargs) as s:
        for _ in s:
            pass
        return s.get_final_completion().choices[0]


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
