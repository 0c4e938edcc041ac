"""A response's tools and grammar: its function tools through the tool-call layer's
checks (``tools/setup.py``) and its ``text.format`` through the structured-output
layer's (``structured.py``), their errors named as the Responses API names the part."""

from __future__ import annotations

import asyncio

from phalanx.engine.core.grammar import Grammar

from . import structured
from .errors import APIError
from .responses_protocol import ResponsesRequest
from .tools import ToolSetup

__all__ = ["responses_grammar", "responses_tools"]


def responses_tools(req: ResponsesRequest, template: str | None) -> ToolSetup | None:
    """A response's tools, through chat's checks; an error names the Responses API's
    part (``tools[0].parameters``: its function tools are flat)."""
    try:
        return ToolSetup.of(req.chat_tools(), req.chat_tool_choice(),
                            req.parallel_tool_calls, template)
    except APIError as exc:
        if exc.param is not None:
            exc.param = exc.param.replace(".function.", ".")
        raise


async def responses_grammar(req: ResponsesRequest, tools: ToolSetup | None
                             ) -> Grammar | None:
    """A response's grammar: its tools' (``required``, a named function) or
    ``text.format``'s (chat's response_format, its errors named as the Responses API
    names the part: ``text.format.schema``); both at once is a 400."""
    forced = await asyncio.to_thread(tools.grammar) if tools is not None else None
    fmt = req.response_format()
    if forced is not None:
        if fmt is not None:
            raise APIError(400, "tool_choice forces a function call, which leaves no room "
                           "for text.format: send one of them", param="tool_choice")
        return forced
    try:
        return await structured.grammar_of(fmt, None)
    except APIError as exc:
        if exc.param is not None:
            exc.param = exc.param.replace("response_format.json_schema", "text.format") \
                .replace("response_format", "text.format")
            exc.message = exc.message.replace("response_format.json_schema",
                                              "text.format")
        raise
