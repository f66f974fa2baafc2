"""One chat choice's text -> ``content``, ``reasoning_content`` and ``tool_calls``, whole
or as OpenAI stream deltas: the reasoning parser (if any) splits the thinking off first,
the tool parser (if any) reads what follows."""

from __future__ import annotations

from kvflow.entrypoints.reasoning_parsers import ReasoningParser
from kvflow.entrypoints.tool_parsers import ToolParser
from kvflow.entrypoints.tool_parsers.base import Event


class ChoiceParser:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None,
                 drop: tuple[str, ...] = ()) -> None:
        self.drop = drop
        """Texts of special tokens (end of turn) removed from the output before parsing:
        they reach the text when detokenization keeps special tokens for the parser."""
        self.reasoning = reasoning
        self.tools = tools
        self.called = False
        """Whether a tool call has started (finish_reason becomes "tool_calls")."""

    def _events(self, text: str, final: bool) -> list[Event]:
        for t in self.drop:  # each is one token, so it arrives whole in one delta
            text = text.replace(t, "")
        if self.reasoning is not None:
            split = self.reasoning.feed(text) if text else []
            if final:
                split += self.reasoning.finish()
        else:
            split = [("content", text)] if text else []
        events: list[Event] = []
        for kind, piece in split:
            if kind == "content" and self.tools is not None:
                events += self.tools.feed(piece)
            else:
                events.append((kind, piece))
        if final and self.tools is not None:
            events += self.tools.finish()
        return events

    def feed(self, text: str) -> dict:
        """The delta fields for this much more text."""
        return self._delta(self._events(text, final=False))

    def finish(self, text: str = "") -> dict:
        """The delta fields for the last text of the choice (and whatever was held back)."""
        return self._delta(self._events(text, final=True))

    def message(self, text: str) -> dict:
        """content, reasoning_content and tool_calls of a whole response."""
        events = self._events(text, final=True)
        content = "".join(e[1] for e in events if e[0] == "content")
        reasoning = "".join(e[1] for e in events if e[0] == "reasoning")
        calls: dict[int, dict] = {}
        for e in events:
            if e[0] == "call":
                calls[e[1]] = {"id": e[2], "type": "function",
                               "function": {"name": e[3], "arguments": ""}}
            elif e[0] == "args":
                calls[e[1]]["function"]["arguments"] += e[2]
        self.called = bool(calls)
        return {"content": content or None,
                "reasoning_content": reasoning or None if self.reasoning else None,
                "tool_calls": [calls[i] for i in sorted(calls)]}

    def _delta(self, events: list[Event]) -> dict:
        delta: dict = {}
        calls: list[dict] = []
        for e in events:
            kind = e[0]
            if kind == "content":
                delta["content"] = delta.get("content", "") + e[1]
            elif kind == "reasoning":
                delta["reasoning_content"] = delta.get("reasoning_content", "") + e[1]
            elif kind == "call":
                self.called = True
                calls.append({"index": e[1], "id": e[2], "type": "function",
                              "function": {"name": e[3], "arguments": ""}})
            elif calls and calls[-1]["index"] == e[1]:
                calls[-1]["function"]["arguments"] += e[2]
            else:
                calls.append({"index": e[1], "function": {"arguments": e[2]}})
        if calls:
            delta["tool_calls"] = calls
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.called else reason
