"""``client.responses.create`` against the real model (issue 46): the answer is right,
and the streamed form ends with ``response.completed`` when the model stops by itself.

One server: the real test model (tests/real_model.py) at TP 1, memory tier only.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import openai
import pytest
from pydantic import BaseModel, Field

from real_model import fetch
from serve_util import Server

QUESTION = "What is the capital of France?"

# the real model's server takes about a minute to start on 2 loaded cores
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server(str(fetch()), "--tp", "1", "--no-prefix-cache-disk")
    yield s
    assert s.stop() == 0


def _client(s: Server) -> openai.OpenAI:
    c: openai.OpenAI = s.openai()
    return c


def _model(s: Server) -> str:
    return str(s.client.get("/v1/models").json()["data"][0]["id"])


def test_the_real_model_answers_paris(server: Server) -> None:
    r = _client(server).responses.create(model=_model(server), input=QUESTION,
                                         temperature=0, max_output_tokens=32)
    assert "Paris" in r.output_text
    assert r.status == "completed" and r.usage is not None
    again = _client(server).responses.create(model=_model(server), input=QUESTION,
                                             temperature=0, max_output_tokens=32)
    assert again.output_text == r.output_text


def test_the_stream_helpers_final_response_is_the_answer(server: Server) -> None:
    with _client(server).responses.stream(model=_model(server), input=QUESTION,
                                          instructions="Answer in one short sentence.",
                                          temperature=0, max_output_tokens=32) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert "Paris" in text and final.output_text == text
    assert final.status == "completed"


class City(BaseModel):
    city: str = Field(max_length=24)
    country: str = Field(max_length=24)


def test_parse_with_a_text_format_gives_a_validated_object(server: Server) -> None:
    r = _client(server).responses.parse(model=_model(server), input=QUESTION,
                                        text_format=City, temperature=0,
                                        max_output_tokens=48)
    assert r.status == "completed"
    parsed = r.output_parsed
    assert isinstance(parsed, City) and "Paris" in parsed.city
    with _client(server).responses.stream(model=_model(server), input=QUESTION,
                                          text_format=City, temperature=0,
                                          max_output_tokens=48) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == parsed


WEATHER = {"type": "function", "name": "get_weather",
           "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False}}


def test_a_function_tool_is_called_and_its_output_answered(server: Server) -> None:
    ask = "What is the weather in Paris?"
    r = _client(server).responses.create(model=_model(server), input=ask, tools=[WEATHER],
                                         tool_choice="required", parallel_tool_calls=False,
                                         temperature=0, max_output_tokens=48)
    (call,) = [i for i in r.output if i.type == "function_call"]
    assert call.name == "get_weather" and "Paris" in json.loads(call.arguments)["city"]
    answer = _client(server).responses.create(
        model=_model(server), tools=[WEATHER], temperature=0, max_output_tokens=48,
        input=[{"role": "user", "content": ask},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id,
                "output": "sunny, 24 degrees Celsius"}])
    assert answer.status == "completed" and answer.output_text


def _vm(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the resident set's peak) of ``pid``, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)
                if k in ("VmRSS", "VmHWM")}


def test_an_idle_rank_gives_back_what_a_long_prompt_freed(server: Server) -> None:
    """A rank keeps one malloc arena warm for its steps, so a 1,500-token prefill's
    freed activations stayed resident for the rank's life (~50-130 MB of the real
    model); once no step comes for a wait slice, the rank gives its free heap pages
    back (engine/worker/heap.py) and says so on /metrics."""
    released = "phalanx:rank_heap_released_bytes"
    before = server.metric(released)   # the trim after loading counts already
    prompt = " ".join(f"word{i}" for i in range(900))
    r = server.client.post("/v1/completions", json={
        "model": _model(server), "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 1500
    deadline = time.monotonic() + 60
    while server.metric(released) <= before:   # gauges are asked of the ranks at most
        assert time.monotonic() < deadline, "the idle rank gave nothing back"   # each 1 s
        time.sleep(0.2)
    vm = _vm(server.rank_pids()[0])
    assert vm["VmRSS"] < vm["VmHWM"] - 20 * 1024, vm
