"""Tool calling (issue 46): one module per job.

``setup.py`` reads a request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``
(and builds the grammar that forces a call); ``render.py`` puts tools, assistant tool
calls and tool results through the model's chat template; ``formats.py`` picks the
model's tool-call format from its template, one parser module each (``hermes.py``,
``llama3.py``, ``mistral.py``; ``calls.py`` what they share), which parse its output,
whole or streamed, into OpenAI's ``tool_calls``; ``answer.py`` shapes a chat answer's
choices with them.
"""

from .answer import ChoiceDeltas, shape_response
from .formats import format_of
from .hermes import HermesStream, parse_hermes
from .render import render_messages
from .setup import ToolSetup

__all__ = ["ChoiceDeltas", "HermesStream", "ToolSetup", "format_of", "parse_hermes",
           "render_messages", "shape_response"]
