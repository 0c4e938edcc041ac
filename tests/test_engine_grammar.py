"""The engine's structured outputs (issue 46): grammars compile once and name the part
they fail on; rank 0's grammar table stays bounded and in step with the parent's; a
constrained sequence preempted and recomputed continues its grammar (its tokens equal
the same request's alone), on the real model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.engine import LLM, SamplingParams, Tokenizer
from phalanx.engine.core.grammar import GrammarTable, compile_grammar
from phalanx.errors import GrammarError
from real_model import fetch

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


def test_grammars_are_cached_by_kind_and_canonical_source() -> None:
    a = compile_grammar("json_schema", SCHEMA)
    b = compile_grammar("json_schema", json.dumps(SCHEMA, indent=2))  # same schema as text
    assert a is b
    assert compile_grammar("regex", "[a-z]+").key != compile_grammar("grammar",
                                                                       "start: /[a-z]+/").key


@pytest.mark.parametrize(("kind", "source", "part"), [
    ("json_schema", {"type": "object", "properties": {"a": {"type": "array", "items": {
        "type": "frobnicate"}}}}, "json_schema at properties.a.items"),
    ("json_schema", {"$ref": "#/$defs/missing"}, "json_schema"),
    ("regex", "(unclosed", "regex"),
    ("grammar", 'start: "a" b\n', "grammar"),
    ("choice", [], "choice"),
    ("json_schema", "{not json", "json_schema"),
])
def test_a_grammar_that_cannot_compile_names_the_part(kind: str, source: object,
                                                      part: str) -> None:
    with pytest.raises(GrammarError, match=f"^{part}"):
        compile_grammar(kind, source)  # type: ignore[arg-type]


def test_the_grammar_table_sends_once_and_stays_bounded() -> None:
    table = GrammarTable(capacity=2)
    g1, g2, g3 = (compile_grammar("regex", f"x{i}") for i in range(3))
    send, drop, done = table.prepare([g1, g1])
    assert send == {g1.key: g1.text} and drop == [] and done == []
    table.commit([g1, g1], drop, done)
    assert table.prepare([g1]) == ({}, [], [])           # rank 0 holds it: not again
    table.commit([g2], *table.prepare([g2])[1:])
    table.finished(7)
    send, drop, done = table.prepare([g3, g2])
    assert send == {g3.key: g3.text} and drop == [g1.key] and done == [7]
    table.commit([g3, g2], drop, done)
    assert table.prepare([g1])[0] == {g1.key: g1.text}   # forgotten: sent again


@pytest.fixture(scope="module")
def gguf() -> Path:
    return fetch()


@pytest.fixture(scope="module")
def small(gguf: Path) -> Iterator[LLM]:
    # a pool too small for four constrained answers at once: the newest are preempted
    with LLM(gguf, tensor_parallel_size=1, page_tokens=16, num_pages=9,
             max_num_batched_tokens=64, max_num_seqs=4, enable_prefix_caching=False) as llm:
        yield llm


LONG = {**SCHEMA, "required": ["name", "age", "scores"], "properties": {
    **SCHEMA["properties"], "scores": {"type": "array", "minItems": 8, "maxItems": 8,
                                       "items": {"type": "integer", "minimum": 10,
                                                 "maximum": 99}}}}


@pytest.mark.slow  # the real model in a KV pool small enough to preempt (~20 s)
def test_a_preempted_sequence_continues_its_grammar(gguf: Path, small: LLM) -> None:
    tok = Tokenizer(gguf)
    asks = ["Alice, 30", "Bob, 41", "Carol, 25"]
    prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": f"A person as JSON: {a}."}]))} for a in asks]
    params = SamplingParams(temperature=0.7, seed=11, max_tokens=90,
                            grammar=compile_grammar("json_schema", LONG))
    alone = [small.generate(p, params)[0].outputs[0] for p in prompts]
    assert small.counters.preemptions == 0
    together = [o.outputs[0] for o in small.generate(prompts, [params] * len(prompts))]
    assert small.counters.preemptions > 0
    for a, t in zip(alone, together, strict=True):
        assert t.token_ids == a.token_ids, (a.text, t.text)
        assert t.finish_reason == "stop"
        doc = json.loads(t.text)
        assert set(doc) == {"name", "age", "scores"} and 0 <= doc["age"] <= 120
        assert len(doc["scores"]) == 8
