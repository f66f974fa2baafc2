"""What every tool-call parser shares: the events it yields, the content sink that keeps
markup and the whitespace around calls out of ``content``, and the scanner that follows
JSON call objects as they arrive.

A parser is an incremental machine: ``feed(delta)`` returns events as the text grows and
``finish()`` the rest. A whole response is parsed by feeding it in one piece
(``parse_text``), so streamed and non-streamed results come from the same code, and the
deltas of a stream always add up to the non-streamed message.

Events are tuples:
  ("content", text)                 text for ``message.content``
  ("call", index, id, name)         a tool call starts (OpenAI's first tool-call delta)
  ("args", index, text)             a fragment of that call's ``function.arguments``
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

Event = tuple

ARG_KEYS = ("arguments", "parameters")


def call_id() -> str:
    """OpenAI-style tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


def short_call_id() -> str:
    """Nine letters and digits: the ids Mistral's chat templates accept in the history."""
    return uuid.uuid4().hex[:9]


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that starts ``marker`` (0 if none): the part
    to hold back because the marker may be arriving."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ContentSink:
    """Content text around tool calls: whitespace that ends a piece of content is held
    until more text follows, so the blank lines before or between calls never reach
    ``content``; without any call, all of it is passed on at the end."""

    def __init__(self) -> None:
        self.held = ""
        self.after_call = False
        self.any_call = False

    def text(self, s: str) -> list[Event]:
        if not s:
            return []
        body = s.rstrip()
        if not body:
            self.held += s
            return []
        head = "" if self.after_call else self.held
        if self.after_call:
            body = body.lstrip()
        self.held = s[len(s.rstrip()):]
        self.after_call = False
        return [("content", head + body)]

    def call(self) -> None:
        self.held = ""
        self.after_call = self.any_call = True

    def finish(self) -> list[Event]:
        held, self.held = self.held, ""
        return [("content", held)] if held and not self.any_call else []


@dataclass
class _ObjectScan:
    members: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    """key -> (value start, value end or None while the value is still arriving)."""
    end: int | None = None
    """Index after the closing brace, once the object is complete."""
    error: bool = False


_WS = " \t\r\n"


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _scan_string(text: str, i: int) -> int | None:
    """``text[i]`` is '"'; the index after the closing quote, or None if not there yet."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def _scan_value(text: str, i: int) -> tuple[int | None, bool]:
    """(index after the JSON value at ``i`` or None while it is incomplete, error)."""
    c = text[i]
    if c == '"':
        return _scan_string(text, i), False
    if c in "{[":
        depth = 0
        while i < len(text):
            c = text[i]
            if c == '"':
                j = _scan_string(text, i)
                if j is None:
                    return None, False
                i = j
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1, False
            i += 1
        return None, False
    j = i
    while j < len(text) and text[j] not in _WS + ",}]":
        j += 1
    if j == i:
        return None, True
    return (j, False) if j < len(text) else (None, False)


def scan_object(text: str, start: int) -> _ObjectScan:
    """Follow the JSON object at ``text[start]`` ('{') as far as it has arrived: where each
    top-level member's value lies, and where the object ends. Only the structure is
    followed; a complete object is checked with json.loads by the caller."""
    scan = _ObjectScan()
    i = _skip_ws(text, start + 1)
    if i < len(text) and text[i] == "}":
        scan.end = i + 1
        return scan
    while i < len(text):
        if text[i] != '"':
            scan.error = True
            return scan
        j = _scan_string(text, i)
        if j is None:
            return scan
        try:
            key = json.loads(text[i:j])
        except ValueError:
            scan.error = True
            return scan
        i = _skip_ws(text, j)
        if i >= len(text):
            return scan
        if text[i] != ":":
            scan.error = True
            return scan
        i = _skip_ws(text, i + 1)
        if i >= len(text):
            return scan
        end, bad = _scan_value(text, i)
        scan.members[key] = (i, end)
        if bad:
            scan.error = True
            return scan
        if end is None:
            return scan
        i = _skip_ws(text, end)
        if i >= len(text):
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] != ",":
            scan.error = True
            return scan
        i = _skip_ws(text, i + 1)
    return scan


def _valid_call(obj: object) -> bool:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return False
    args = [obj[k] for k in ARG_KEYS if k in obj]
    if not args:
        return True
    a = args[0]
    if isinstance(a, str):
        try:
            a = json.loads(a)
        except ValueError:
            return False
    return isinstance(a, dict)


class CallRegion:
    """The text of one run of tool calls (what follows a start marker): JSON call objects
    ``{"name": ..., "arguments": {...}}`` (or ``"parameters"``), alone or in a JSON
    array, separated by commas, semicolons or whitespace. ``update(region, complete)``
    is called with all of the region so far and returns the new events; a call's
    header goes out once its name is complete and its arguments have begun, then the
    argument text as it arrives (the model's own JSON text, so streamed fragments and the
    final string are the same)."""

    def __init__(self, first_index: int, max_calls: int | None = None,
                 new_id=call_id) -> None:
        self.new_id = new_id
        self.next_index = first_index
        self.max_calls = max_calls
        self.pos = 0            # where the current object starts (or the scan resumes)
        self.emitted = False    # any event of this region sent
        self.bad = False        # the region stopped being tool calls
        self.cur_index: int | None = None
        self.cur_args_sent = 0
        self.array = False

    def _skip_separators(self, text: str, i: int, first: bool) -> int:
        i = _skip_ws(text, i)
        if first and i < len(text) and text[i] == "[":
            self.array = True
            i = _skip_ws(text, i + 1)
        while i < len(text) and text[i] in ",;":
            i = _skip_ws(text, i + 1)
        return i

    def _all_valid(self, text: str) -> bool:
        """A complete region: every object parses as a call and nothing else is there."""
        i, n = self._skip_separators(text, 0, True), 0
        while i < len(text):
            if text[i] == "]" and self.array:
                return _skip_ws(text, i + 1) == len(text) and n > 0
            if text[i] != "{":
                return False
            scan = scan_object(text, i)
            if scan.error or scan.end is None:
                return False
            try:
                if not _valid_call(json.loads(text[i:scan.end])):
                    return False
            except ValueError:
                return False
            n += 1
            i = self._skip_separators(text, scan.end, False)
        return n > 0 and not self.array

    def update(self, text: str, complete: bool) -> list[Event]:
        if self.bad:
            return []
        if complete and not self.emitted and not self._all_valid(text):
            self.bad = True
            return []
        events: list[Event] = []
        while True:
            if self.cur_index is None:
                i = self._skip_separators(text, self.pos, self.pos == 0)
                if i >= len(text) or (self.array and text[i] == "]"):
                    self.pos = i
                    return events
                if text[i] != "{":
                    self.bad = not self.emitted
                    return events
                self.pos = i
            scan = scan_object(text, self.pos)
            if scan.error:
                self.bad = not self.emitted
                return events
            events += self._emit(text, scan)
            if scan.end is None:
                return events
            if self.cur_index is None:  # not a call: stop here
                self.bad = not self.emitted
                return events
            self.cur_index, self.cur_args_sent = None, 0
            self.pos = scan.end

    def _emit(self, text: str, scan: _ObjectScan) -> list[Event]:
        events: list[Event] = []
        name_span = scan.members.get("name")
        arg_key = next((k for k in ARG_KEYS if k in scan.members), None)
        if self.cur_index is None:
            if name_span is None or name_span[1] is None:
                return events
            if arg_key is None and scan.end is None:
                return events
            try:
                name = json.loads(text[name_span[0]:name_span[1]])
            except ValueError:
                return events
            if not isinstance(name, str) or not name:
                return events
            if self.max_calls is not None and self.next_index >= self.max_calls:
                self.cur_index = -1  # past the limit: follow it, send nothing
            else:
                self.cur_index = self.next_index
                self.next_index += 1
                events.append(("call", self.cur_index, self.new_id(), name))
            self.emitted = True
        if self.cur_index < 0:
            return events
        if arg_key is None:
            if scan.end is not None:
                events.append(("args", self.cur_index, "{}"))
            return events
        start, end = scan.members[arg_key]
        if text[start] == '"':  # arguments sent as a JSON string: pass its text on whole
            if end is not None and not self.cur_args_sent:
                events.append(("args", self.cur_index, json.loads(text[start:end])))
                self.cur_args_sent = end - start
            return events
        stop = end if end is not None else len(text)
        if end is None:  # the value's last characters may be the object's own closing
            stop = start + _open_prefix(text[start:])
        if stop - start > self.cur_args_sent:
            events.append(("args", self.cur_index, text[start + self.cur_args_sent:stop]))
            self.cur_args_sent = stop - start
        return events


def _open_prefix(value: str) -> int:
    """How much of an incomplete JSON object's text may go out now: all but trailing
    whitespace (which may turn out to be outside the value)."""
    return len(value.rstrip(_WS))


class ToolParser:
    """Base of the tool-call parsers: subclasses implement ``feed`` and ``finish``."""

    name = ""
    needs_special_tokens = False
    """True when the format's markers are special tokens, which detokenization must keep."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls

    new_id = staticmethod(call_id)
    """Makes the id of each call."""

    def feed(self, delta: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError


def parse_text(parser: ToolParser, text: str) -> tuple[str | None, list[dict]]:
    """A whole response: (content or None, OpenAI tool_calls)."""
    return collect(parser.feed(text) + parser.finish())


def collect(events: list[Event]) -> tuple[str | None, list[dict]]:
    content: list[str] = []
    calls: dict[int, dict] = {}
    for e in events:
        if e[0] == "content":
            content.append(e[1])
        elif e[0] == "call":
            calls[e[1]] = {"id": e[2], "type": "function",
                           "function": {"name": e[3], "arguments": ""}}
        else:
            calls[e[1]]["function"]["arguments"] += e[2]
    text = "".join(content)
    return (text or None), [calls[i] for i in sorted(calls)]
