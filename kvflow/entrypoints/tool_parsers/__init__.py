"""Tool-call parsers: the model's text -> OpenAI ``tool_calls``, one parser per output
format, streamed or whole (see base.py for the event protocol)."""

from __future__ import annotations

from kvflow.entrypoints.tool_parsers.base import (ToolParser, collect, parse_text)
from kvflow.entrypoints.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from kvflow.entrypoints.tool_parsers.hermes import HermesToolParser
from kvflow.entrypoints.tool_parsers.llama3 import Llama3JsonToolParser
from kvflow.entrypoints.tool_parsers.mistral import MistralToolParser
from kvflow.errors import InvalidParameterError

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def tool_parser_class(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise InvalidParameterError(
            f"unknown tool call parser {name!r}; choose one of "
            f"{', '.join(sorted(TOOL_PARSERS))}", param="tool_call_parser") from None


def detect_tool_parser(template: str | None) -> str:
    """The parser for a chat template's tool format: what the template tells the model to
    write. Templates without tools get kvflow's default tool prompt, which asks for
    Hermes-style calls."""
    t = template or ""
    if "[TOOL_CALLS]" in t or "[AVAILABLE_TOOLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or ("ipython" in t and '"parameters"' in t):
        return "llama3_json"
    return "hermes"


__all__ = ["TOOL_PARSERS", "ToolParser", "NamedCallParser", "RequiredCallsParser",
           "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser",
           "collect", "detect_tool_parser", "parse_text", "tool_parser_class"]
