"""Tools, assistant tool calls and tool results through the model's chat template.

A template that declares tools (it reads ``tools``, as Qwen's, Llama 3.1's and
Mistral's do) gets them as transformers passes them: ``tools=[{"type": "function",
"function": {...}}]``, assistant messages with ``tool_calls`` (arguments as objects)
and ``role: "tool"`` messages with ``tool_call_id``. A template that does not (SmolLM2's
renders role and content only) gets the Hermes convention written into the messages: a
system message listing the tools in ``<tools>`` and saying how to call them, calls as
``<tool_call>`` text, results as ``<tool_response>`` text, so the model sees the
exchange and the server parses its answer with ``hermes.py``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateSyntaxError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["declares_tools", "render_messages"]

JSON = dict[str, Any]
_ENV = ImmutableSandboxedEnvironment()

_SYSTEM = ("You may call one or more functions to assist with the user query. Function "
           "signatures are given within <tools></tools> XML tags:\n<tools>\n{tools}\n"
           "</tools>\n\nFor each function call, return a JSON object with the function name "
           "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
           '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def declares_tools(template: str | None) -> bool:
    """Whether ``template`` reads a ``tools`` variable (jinja's own parse, not a search)."""
    if template is None:
        return False
    try:
        return "tools" in meta.find_undeclared_variables(_ENV.parse(template))
    except TemplateSyntaxError:
        return False


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def render_messages(messages: Sequence[JSON], tools: list[JSON] | None,
                    template: str | None) -> tuple[list[JSON], JSON]:
    """The messages and the extra template variables for ``messages`` with ``tools``."""
    if declares_tools(template):
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "function": {
                    **c["function"], "arguments": _arguments(c["function"]["arguments"])}}
                    for c in m["tool_calls"]]
            out.append(m)
        return out, ({"tools": tools} if tools else {})
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments":
                                              _arguments(c["function"]["arguments"])})
                + "\n</tool_call>" for c in m["tool_calls"])
            text = (m.get("content") or "").strip()
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        elif m["role"] == "tool":
            out.append({"role": "tool", "content":
                        f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if tools:
        listing = "\n".join(json.dumps(t) for t in tools)
        system = _SYSTEM.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, {}
