"""Structured-output grammars on the parent's side: compile and check once, cache by key.

A request's constraint (a JSON schema, any JSON object, a regex, a choice of strings, a
Lark grammar) becomes a :class:`Grammar`: llguidance's grammar text and a key (a digest
of the kind and the canonical source). Compiling checks the grammar without a
tokenizer; a grammar llguidance refuses is a :class:`GrammarError` naming the part
(for a JSON schema, the deepest sub-schema that fails on its own: ``properties.age``).
Compiled grammars are cached by key (an LRU of :data:`CACHE_SIZE`): the server's
repeated schemas compile once.

The masks are the rank's (``engine/worker/grammar.py``): rank 0, which samples, keeps a
matcher per sequence built from the grammar text, which reaches it once per key in the
step plan (``StepPlan.grammars``; :class:`GrammarTable` decides when). docs/design.md,
issue 46, records why llguidance and not xgrammar, with the measurements.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import gbnf_to_lark

from .._errors import GrammarError

__all__ = ["CACHE_SIZE", "JSON_STYLE", "Grammar", "GrammarKind", "GrammarTable",
           "compile_grammar"]

# "grammar": a client's Lark or GBNF; "lark": the server's own Lark (tool calls)
GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "lark"]
CACHE_SIZE = 256           # compiled grammars kept in the parent (and sent to rank 0)
MAX_SOURCE = 256 << 10     # characters of one schema, regex or grammar
MAX_CHOICES = 1024
# JSON is written as json.dumps writes it (", " and ": ", no other whitespace): with
# llguidance's default flexible whitespace a model may write whitespace until max_tokens
# (the embedded model did, every time, at temperature 0 and 0.8). A schema's own
# "x-guidance" options are overridden; a Lark grammar's %json takes these under its
# schema's "x-guidance" key (tools/: the call grammars).
JSON_STYLE: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ",
                              "key_separator": ": "}


@dataclass(frozen=True)
class Grammar:
    """A checked grammar: ``text`` is llguidance's grammar, ``key`` names it on the ranks."""

    kind: GrammarKind
    key: str
    text: str


_cache: OrderedDict[str, Grammar] = OrderedDict()
_lock = threading.Lock()


def compile_grammar(kind: GrammarKind, source: Any) -> Grammar:
    """The checked grammar of ``source`` (a schema dict or JSON text, a regex, a list of
    strings, a Lark grammar; None for ``json_object``); cached by kind and source.
    Raises :class:`GrammarError` naming the part that does not compile."""
    canon = _canonical(kind, source)
    key = hashlib.blake2b(f"{kind}\0{canon}".encode(), digest_size=12).hexdigest()
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    grammar = Grammar(kind, key, _build(kind, canon))
    with _lock:
        _cache[key] = grammar
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return grammar


def _canonical(kind: GrammarKind, source: Any) -> str:
    if kind == "json_object":
        return ""
    if kind == "json_schema":
        if isinstance(source, str):
            try:
                source = json.loads(source)
            except ValueError as exc:
                raise GrammarError(f"json_schema: not valid JSON: {exc}") from None
        if not isinstance(source, (dict, bool)):
            raise GrammarError("json_schema: a schema must be a JSON object")
        text = json.dumps(source, sort_keys=True, separators=(",", ":"))
    elif kind == "choice":
        if (not isinstance(source, Sequence) or isinstance(source, str) or not source
                or not all(isinstance(c, str) and c for c in source)):
            raise GrammarError("choice: a non-empty list of non-empty strings")
        if len(source) > MAX_CHOICES:
            raise GrammarError(f"choice: at most {MAX_CHOICES} choices, got {len(source)}")
        text = json.dumps(list(source))
    else:
        if not isinstance(source, str) or not source:
            raise GrammarError(f"{kind}: a non-empty string")
        text = source
    if len(text) > MAX_SOURCE:
        raise GrammarError(f"{kind}: {len(text)} characters; at most {MAX_SOURCE}")
    return text


def _build(kind: GrammarKind, canon: str) -> str:
    if kind == "json_object":
        text = LLMatcher.grammar_from_json_schema({"type": "object"},
                                                  overrides=cast(Any, JSON_STYLE))
    elif kind == "json_schema":
        text = LLMatcher.grammar_from_json_schema(canon, overrides=cast(Any, JSON_STYLE))
    elif kind == "regex":
        text = LLMatcher.grammar_from_regex(canon)
    elif kind == "choice":
        alts = " | ".join(json.dumps(c) for c in json.loads(canon))
        text = LLMatcher.grammar_from_lark(f"start: {alts}\n")
    else:
        source = canon
        # GBNF (llama.cpp's, as vLLM's xgrammar backend takes it)
        if kind == "grammar" and "::=" in source:
            try:
                source = gbnf_to_lark(source)
            except Exception as exc:  # noqa: BLE001  the converter's own error, named
                raise GrammarError(f"grammar: not a GBNF grammar this engine reads: "
                                   f"{exc}") from None
        text = LLMatcher.grammar_from_lark(source)
    why = _why(text)
    if why is not None:
        where = _deepest(json.loads(canon)) if kind == "json_schema" else None
        part = f"json_schema at {where}" if where else kind
        raise GrammarError(f"{part}: the grammar engine cannot compile it: {why}")
    return text


def _why(text: str) -> str | None:
    """llguidance's reason for refusing ``text``, or None when it compiles."""
    failed, messages = LLMatcher.validate_grammar_with_warnings(text)
    return "; ".join(m.strip() for m in messages) or "invalid" if failed else None


def _deepest(schema: Any) -> str | None:
    """The path of the deepest sub-schema of ``schema`` that fails on its own (with the
    root's definitions beside it, so references still resolve), or None."""
    if not isinstance(schema, dict):
        return None
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    return _deepest_under(schema, "", defs)


def _deepest_under(schema: dict[str, Any], path: str, defs: dict[str, Any]) -> str | None:
    for sub_path, sub in _children(schema, path):
        if not isinstance(sub, dict):
            continue
        try:
            text = LLMatcher.grammar_from_json_schema({**sub, **defs})
        except ValueError:
            continue
        if _why(text) is not None:
            return _deepest_under(sub, sub_path, defs) or sub_path
    return None


def _children(schema: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(path, sub-schema) of each direct sub-schema, in the order they appear."""
    if not isinstance(schema, dict):
        return
    dot = f"{path}." if path else ""
    for name in ("properties", "$defs", "definitions", "patternProperties"):
        block = schema.get(name)
        if isinstance(block, dict):
            for k, v in block.items():
                yield f"{dot}{name}.{k}", v
    for name in ("items", "additionalProperties", "not", "contains"):
        if isinstance(schema.get(name), dict):
            yield f"{dot}{name}", schema[name]
    for name in ("anyOf", "oneOf", "allOf", "prefixItems"):
        block = schema.get(name)
        if isinstance(block, list):
            for i, v in enumerate(block):
                yield f"{dot}{name}[{i}]", v


class GrammarTable:
    """Which grammars rank 0 holds, mirrored in the parent: a grammar's text rides the
    step plan the first time a step needs it (``StepPlan.grammars``), and what the
    mirror forgets rank 0 forgets (``StepPlan.grammar_drop``), so both stay bounded
    (a matcher, once built, needs no text). Sequences whose matchers rank 0 may drop
    ride ``StepPlan.grammar_done``.

    ``prepare`` says what a plan must carry; ``commit`` records it once the plan left
    (a plan that failed to encode left nothing behind)."""

    def __init__(self, capacity: int = CACHE_SIZE) -> None:
        self._held: OrderedDict[str, None] = OrderedDict()
        self._capacity = capacity
        self._done: list[int] = []

    def finished(self, seq_id: int) -> None:
        """A sequence with a grammar ended: rank 0 may drop its matcher."""
        self._done.append(seq_id)

    def prepare(self, grammars: Sequence[Grammar]
                ) -> tuple[dict[str, str], list[str], list[int]]:
        """What the next plan carries for the grammars its sequences sample under: the
        texts rank 0 lacks, the keys it should drop, the sequences that ended."""
        used = {g.key for g in grammars}
        send = {g.key: g.text for g in grammars if g.key not in self._held}
        over = len(self._held) + len(send) - self._capacity
        drop = [k for k in self._held if k not in used][: max(0, over)]
        return send, drop, list(self._done)

    def commit(self, grammars: Sequence[Grammar], drop: list[str], done: list[int]) -> None:
        for k in drop:
            self._held.pop(k, None)
        for g in grammars:
            self._held[g.key] = None
            self._held.move_to_end(g.key)
        del self._done[: len(done)]
