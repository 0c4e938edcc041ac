"""Which tool-call format a model speaks, chosen by what its chat template declares.

Each format is a module with one job (``hermes.py``, ``llama3.py``, ``mistral.py``):
parse a whole answer, parse a streamed one, and write the Lark grammar that forces
calls to its shape. A template that writes ``<tool_call>`` (Qwen 2/2.5/3, Hermes) or
declares no tools at all (SmolLM2: the Hermes convention is then written into the
messages, ``render.py``) is Hermes; one that writes ``[TOOL_CALLS]`` is Mistral's; one
that writes ``<|python_tag|>`` or the ``ipython`` role is Llama 3.x's JSON.
"""

from __future__ import annotations

from typing import Any, Protocol

from . import hermes, llama3, mistral

__all__ = ["ToolFormat", "ToolStream", "format_of"]

JSON = dict[str, Any]


class ToolStream(Protocol):
    calls: int

    def feed(self, text: str) -> list[JSON]: ...

    def finish(self) -> list[JSON]: ...


class ToolFormat(Protocol):
    NAME: str
    KEEP_SPECIAL: bool    # its markers are special tokens: the text must keep them

    def parse(self, text: str) -> tuple[str | None, list[JSON]]: ...

    def stream(self) -> ToolStream: ...

    def grammar(self, schemas: list[JSON], parallel: bool) -> str: ...

    def lazy_grammar(self, schemas: list[JSON]) -> str | None: ...


def format_of(template: str | None) -> ToolFormat:
    """The tool-call format of a model with chat ``template``."""
    t = template or ""
    if "<tool_call>" in t:
        return hermes.FORMAT
    if "[TOOL_CALLS]" in t:
        return mistral.FORMAT
    if "<|python_tag|>" in t or "ipython" in t:
        return llama3.FORMAT
    return hermes.FORMAT
