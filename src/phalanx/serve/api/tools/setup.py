"""A request's tools: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` checked,
and the grammar that makes ``required`` and a named function always give calls whose
arguments parse and match the function's ``parameters`` schema.

The grammar is the model's format's (``formats.py``; Hermes: ``<tool_call>\\n{json}\\n
</tool_call>``), once, or one or more times when ``parallel_tool_calls`` is true
(OpenAI's default), the JSON an ``anyOf`` over the allowed functions of ``{"name":
const, "arguments": parameters}``; after the last call only EOS is allowed. Under
``auto`` the model chooses: its text is free, but a call it opens (Hermes: once it
writes ``<tool_call>``, llguidance's lazy trigger) must be one of the functions with
valid arguments; formats without such a grammar are parsed, not constrained.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from phalanx.engine import SamplingParams
from phalanx.engine.core.grammar import Grammar, compile_grammar
from phalanx.errors import GrammarError

from ..errors import APIError
from .formats import ToolFormat, format_of

__all__ = ["ToolSetup"]

JSON = dict[str, Any]


@dataclass(frozen=True)
class ToolSetup:
    """``tools`` as OpenAI's dicts; ``choice``: "none", "auto", "required" or a name;
    ``fmt``: the served model's tool-call format."""

    tools: list[JSON]
    choice: str
    parallel: bool
    fmt: ToolFormat

    @classmethod
    def of(cls, tools: Any, tool_choice: Any, parallel: Any,
           template: str | None) -> ToolSetup | None:
        """The request's tools (None: it has none); a 400 naming the field if wrong."""
        if not tools:
            if tool_choice not in (None, "none", "auto"):
                raise APIError(400, "tool_choice needs tools: send the functions in tools",
                               param="tool_choice")
            return None
        if not isinstance(tools, list):
            raise APIError(400, "tools must be a list of function tools", param="tools")
        names: list[str] = []
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type") != "function" \
                    or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise APIError(400, f"tools[{i}]: a tool is {{\"type\": \"function\", "
                               f"\"function\": {{\"name\": ..., \"parameters\": {{...}}}}}}",
                               param=f"tools[{i}]")
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema "
                               "object", param=f"tools[{i}].function.parameters")
            names.append(fn["name"])
        choice = cls._choice(tool_choice, names)
        if parallel is not None and not isinstance(parallel, bool):
            raise APIError(400, "parallel_tool_calls must be true or false",
                           param="parallel_tool_calls")
        return cls(list(tools), choice, parallel is not False, format_of(template))

    @staticmethod
    def _choice(tool_choice: Any, names: list[str]) -> str:
        if tool_choice is None:
            return "auto"
        if tool_choice in ("none", "auto", "required"):
            return str(tool_choice)
        fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or tool_choice.get("type") != "function":
            raise APIError(400, "tool_choice is \"none\", \"auto\", \"required\" or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                           param="tool_choice")
        if name not in names:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not in "
                           f"tools ({', '.join(names)})", param="tool_choice")
        return name

    @property
    def parses(self) -> bool:
        """Whether the answer is parsed for calls (not under ``tool_choice: none``)."""
        return self.choice != "none"

    def grammar(self) -> Grammar | None:
        """The grammar of the calls: forced (``required``, a named function), or, under
        ``auto``, free text in which a call the model opens must be valid (where the
        format has such a grammar); None under ``none``."""
        if self.choice == "none":
            return None
        fns = [t["function"] for t in self.tools
               if self.choice in ("required", "auto") or t["function"]["name"] == self.choice]
        lark = self.fmt.lazy_grammar(fns) if self.choice == "auto" else self.fmt.grammar(
            fns, self.parallel)
        if lark is None:
            return None
        try:
            return compile_grammar("lark", lark)
        except GrammarError as exc:
            raise APIError(400, f"tools: a function's parameters cannot be compiled: {exc}",
                           param="tools", code="invalid_structured_output") from None

    def sampling(self, params: list[SamplingParams]) -> list[SamplingParams]:
        """``params`` as the format needs them: its markers kept in the text where they
        are special tokens (Mistral's ``[TOOL_CALLS]``, Llama's ``<|python_tag|>``)."""
        if not (self.parses and self.fmt.KEEP_SPECIAL):
            return params
        return [replace(p, skip_special_tokens=False) for p in params]
