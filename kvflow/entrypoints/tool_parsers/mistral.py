"""Mistral tool calls: ``[TOOL_CALLS]`` (a control token, kept in the text for this
parser) followed by a JSON array of ``{"name": ..., "arguments": {...}}`` objects; text
before it is content."""

from __future__ import annotations

from kvflow.entrypoints.tool_parsers.base import short_call_id
from kvflow.entrypoints.tool_parsers.marked import MarkedCallsParser


class MistralToolParser(MarkedCallsParser):
    name = "mistral"
    needs_special_tokens = True
    start = "[TOOL_CALLS]"
    end = None
    new_id = staticmethod(short_call_id)
