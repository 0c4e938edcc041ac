"""The tool-call formats on text (issue 46): each parses a whole answer and a stream fed a
character at a time to the same calls, OpenAI's deltas carry a call's id and name first
and then its arguments in fragments, the template picks the format, and each format's
forcing grammar compiles."""

from __future__ import annotations

import json
from typing import Any

import pytest

from phalanx.engine.core.grammar import compile_grammar
from phalanx.serve.api.tools import HermesStream, format_of, parse_hermes

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}},
             "required": ["city"]}}}]


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
    # the grammars of this format's calls compile: forced once, forced in parallel, auto
    fns = [t["function"] for t in TOOLS]
    for parallel in (False, True):
        compile_grammar("lark", fmt.grammar(fns, parallel))
    lazy = fmt.lazy_grammar(fns)   # auto's: free text, valid calls (Hermes)
    assert (lazy is not None) == (name == "hermes")
    if lazy is not None:
        compile_grammar("lark", lazy)
