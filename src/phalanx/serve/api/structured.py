"""A request's structured-output constraint, as the engine's grammar (issue 46).

OpenAI's ``response_format`` (``json_object``, ``json_schema`` with ``strict``) and
vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``: exactly one) become one
:class:`~phalanx.engine.core.grammar.Grammar`, compiled off the event loop and cached
by the engine. A constraint the grammar engine cannot compile is a 400 naming the
field and the part (``response_format.json_schema.schema``: ``json_schema at
properties.age: ...``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from phalanx.engine.core.grammar import Grammar, GrammarKind, compile_grammar
from phalanx.errors import GrammarError

from .errors import APIError
from .protocol import ResponseFormat, StructuredOutputs

__all__ = ["constraint_of", "grammar_of"]

Constraint = tuple[GrammarKind, Any, str]   # kind, source, the request field it came from


def constraint_of(response_format: ResponseFormat | None,
                  structured: StructuredOutputs | None) -> Constraint | None:
    """The one constraint a request asks for (None: free text); a 400 when it asks for
    more than one or leaves one empty."""
    found: list[Constraint] = []
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            found.append(("json_object", None, "response_format"))
        else:
            spec = response_format.json_schema
            if spec is None or spec.schema is None:
                raise APIError(400, "response_format of type json_schema needs "
                               "json_schema.schema (the JSON schema of the answer)",
                               param="response_format.json_schema")
            found.append(("json_schema", spec.schema, "response_format.json_schema.schema"))
    if structured is not None:
        before = len(found)
        for name, kind in (("json", "json_schema"), ("regex", "regex"),
                           ("choice", "choice"), ("grammar", "grammar")):
            value = getattr(structured, name)
            if value is not None:
                found.append((kind, value, f"structured_outputs.{name}"))  # type: ignore[arg-type]
        if structured.json_object:
            found.append(("json_object", None, "structured_outputs.json_object"))
        if len(found) == before:
            raise APIError(400, "structured_outputs names no constraint: send one of json, "
                           "regex, choice, grammar or json_object",
                           param="structured_outputs")
    if len(found) > 1:
        names = ", ".join(f[2] for f in found)
        raise APIError(400, f"one structured-output constraint per request; this one has "
                       f"{len(found)}: {names}", param=found[1][2])
    return found[0] if found else None


def _compile(constraint: Constraint) -> Grammar:
    kind, source, param = constraint
    try:
        return compile_grammar(kind, source)
    except GrammarError as exc:
        raise APIError(400, f"{param}: {exc}", param=param,
                       code="invalid_structured_output") from None


async def grammar_of(response_format: ResponseFormat | None,
                     structured: StructuredOutputs | None) -> Grammar | None:
    """The compiled grammar of a request's constraint (None: free text), compiled on a
    thread: a large schema takes milliseconds the event loop owes everyone else."""
    constraint = constraint_of(response_format, structured)
    if constraint is None:
        return None
    return await asyncio.to_thread(_compile, constraint)
