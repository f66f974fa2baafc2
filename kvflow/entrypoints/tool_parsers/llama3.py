"""Llama 3.1/3.2 JSON tool calls: the response is ``{"name": ..., "parameters": {...}}``
(several separated by ``;``), with or without a leading ``<|python_tag|>`` (a special
token, kept in the text for this parser). A response that starts with anything else is
plain content, as is JSON that is not a call."""

from __future__ import annotations

from kvflow.entrypoints.tool_parsers.base import Event, partial_suffix
from kvflow.entrypoints.tool_parsers.marked import MarkedCallsParser


class Llama3JsonToolParser(MarkedCallsParser):
    name = "llama3_json"
    needs_special_tokens = True
    start = "<|python_tag|>"
    end = None

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self.decided = False

    def _run(self, final: bool) -> list[Event]:
        if not self.decided:
            head = self.buf.lstrip()
            if not head or (not final and partial_suffix(head, self.start) == len(head)):
                if final:
                    self.decided = True
                    return super()._run(final)
                return []  # too early to tell
            self.decided = True
            if head.startswith("{"):
                self.buf = head
                self._open("")
            elif not head.startswith(self.start):
                self.passthrough = True
        return super()._run(final)
