"""Hermes-style tool calls (Qwen2.5, Qwen3, Hermes, and kvflow's default tool prompt):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, text before them is content."""

from __future__ import annotations

from kvflow.entrypoints.tool_parsers.marked import MarkedCallsParser


class HermesToolParser(MarkedCallsParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"
