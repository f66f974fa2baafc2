"""The outputs of ``tool_choice`` "required" and a named function, which the grammar
engine constrains (see kvflow/entrypoints/tools.py for the schemas):

- named: the output is the arguments object itself; the call's header goes out first,
  then every piece of text as an argument fragment;
- required: the output is a JSON array of ``{"name": ..., "arguments": {...}}``,
  followed like any other run of calls.
"""

from __future__ import annotations

from kvflow.entrypoints.tool_parsers.base import CallRegion, Event, ToolParser, call_id


class NamedCallParser(ToolParser):
    name = "named"

    def __init__(self, function: str) -> None:
        super().__init__(1)
        self.function = function
        self.started = False

    def feed(self, delta: str) -> list[Event]:
        events: list[Event] = []
        if not self.started:
            self.started = True
            events.append(("call", 0, call_id(), self.function))
        if delta:
            events.append(("args", 0, delta))
        return events

    def finish(self) -> list[Event]:
        return self.feed("") if not self.started else []


class RequiredCallsParser(ToolParser):
    name = "required"

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self.text = ""
        self.region = CallRegion(0, max_calls)

    def feed(self, delta: str) -> list[Event]:
        self.text += delta
        return self.region.update(self.text, complete=False)

    def finish(self) -> list[Event]:
        events = self.region.update(self.text, complete=True)
        if self.region.bad:  # cut short by max_tokens before any call was whole
            return events + ([("content", self.text)] if self.text else [])
        return events
