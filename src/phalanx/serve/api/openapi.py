"""``GET /openapi.json``: the API's OpenAPI 3.1 description, generated from the request
structs themselves (``protocol.py``), so it cannot drift from what the server decodes.

It is what an API fuzzer reads (the suite's schemathesis run, tests/test_serve_fuzz.py)
and what vLLM's server publishes at the same path. Response bodies are described by
status and media type only; their shapes are OpenAI's.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from .responses_protocol import ResponsesRequest

__all__ = ["openapi_document"]

_REF = "#/components/schemas/{name}"

# POST routes: path -> (request struct, summary, whether it streams)
_POSTS: dict[str, tuple[type[msgspec.Struct], str, bool]] = {
    "/v1/completions": (CompletionRequest, "Create a completion", True),
    "/v1/chat/completions": (ChatCompletionRequest, "Create a chat completion", True),
    "/v1/responses": (ResponsesRequest, "Create a response (stateless)", True),
    "/tokenize": (TokenizeRequest, "Tokenize a prompt or chat messages", False),
    "/detokenize": (DetokenizeRequest, "Token ids back to text", False),
}
_GETS = {
    "/v1/models": ("List the served model", "application/json"),
    "/health": ("Health: 200 while every rank serves, else 503", "application/json"),
    "/metrics": ("Prometheus metrics", "text/plain"),
    "/state": ("The server's state as JSON, from the figures of /metrics (the web page "
               "polls it)", "application/json"),
}


def _error(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": _REF.format(name="Error")}}}}


_ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}}}},
}


def _any(kind: type) -> dict[str, Any]:
    """``object`` (a content part's values): any JSON value."""
    if kind is object:
        return {"description": "any JSON value"}
    raise TypeError(f"no JSON schema for {kind!r}")


def openapi_document(model_name: str, auth: bool) -> dict[str, Any]:
    """The whole document for a server of ``model_name`` (``auth``: behind an API key)."""
    refs, schemas = msgspec.json.schema_components(
        [kind for kind, _, _ in _POSTS.values()], ref_template=_REF, schema_hook=_any)
    schemas["Error"] = _ERROR_SCHEMA
    paths: dict[str, Any] = {}
    for (path, (_, summary, streams)), ref in zip(_POSTS.items(), refs, strict=True):
        ok: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
        if streams:
            ok["text/event-stream"] = {"schema": {"type": "string"}}
        paths[path] = {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": ref}}},
            "responses": {
                "200": {"description": "OK", "content": ok},
                "400": _error("a malformed body or a bad field, named in param"),
                "401": _error("a missing or wrong API key"),
                "404": _error("an unknown model"),
                "413": _error("a body over the size limit"),
                "503": _error("at capacity, or the engine is down: retry after Retry-After"),
            }}}
    for path, (summary, media) in _GETS.items():
        paths[path] = {"get": {"summary": summary, "responses": {
            "200": {"description": "OK", "content": {media: {"schema": {}}}},
            **({"503": _error("not serving")} if path == "/health" else {})}}}
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": f"phalanx serve: {model_name}", "version": "1",
                 "description": "An OpenAI-compatible API (completions, chat, responses)."},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http",
                                                           "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc
