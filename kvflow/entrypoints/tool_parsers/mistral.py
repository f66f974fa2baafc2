"""Mistral tool calls, after ``[TOOL_CALLS]`` (a control token, kept in the text for this
parser); text before it is content. Two formats:

- tokenizers up to v7: a JSON array ``[{"name": ..., "arguments": {...}}, ...]``;
- tokenizers v11+ (Mistral Small 3.2, Magistral, Devstral): ``name[ARGS]{...}``, each
  further call after its own ``[TOOL_CALLS]``.
"""

from __future__ import annotations

import json
import re

from kvflow.entrypoints.tool_parsers.base import (CallRegion, Event, Nesting, _scan_value,
                                                  _skip_ws, partial_suffix, rstrip_end,
                                                  short_call_id)
from kvflow.entrypoints.tool_parsers.marked import MarkedCallsParser

_ARGS = "[ARGS]"
_SEP = "[TOOL_CALLS]"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class _NameArgsRegion:
    """``name[ARGS]{json}`` calls (v11+), followed as they arrive; same interface as
    CallRegion."""

    def __init__(self, first_index: int, max_calls: int | None, new_id) -> None:
        self.next_index, self.max_calls, self.new_id = first_index, max_calls, new_id
        self.pos = 0
        self.emitted = self.bad = False
        self.cur: int | None = None   # index of the call whose arguments are arriving
        self.args_at = 0
        self.sent = 0
        self.nest: Nesting | None = None

    def _calls(self, text: str) -> list[tuple[str, str]] | None:
        """All calls of a complete region, or None if it is not calls."""
        calls, i = [], 0
        while True:
            i = self._skip(text, i)
            if i >= len(text):
                return calls or None
            k = text.find(_ARGS, i)
            if k < 0 or not _NAME.fullmatch(text[i:k].strip()):
                return None
            j = _skip_ws(text, k + len(_ARGS))
            if j >= len(text) or text[j] != "{":
                return None
            end, bad = _scan_value(text, j)
            if end is None or bad:
                return None
            try:
                if not isinstance(json.loads(text[j:end]), dict):
                    return None
            except ValueError:
                return None
            calls.append((text[i:k].strip(), text[j:end]))
            i = end

    @staticmethod
    def _skip(text: str, i: int) -> int:
        while True:
            i = _skip_ws(text, i)
            if not text.startswith(_SEP, i):
                return i
            i += len(_SEP)

    def update(self, text: str, complete: bool) -> list[Event]:
        if self.bad:
            return []
        if complete and not self.emitted and self._calls(text) is None:
            self.bad = True
            return []
        events: list[Event] = []
        while True:
            if self.cur is None:
                i = self._skip(text, self.pos)
                k = text.find(_ARGS, i)
                if k < 0:
                    rest = text[i:]
                    rest = rest[:len(rest) - partial_suffix(rest, _ARGS)]
                    rest = rest[:len(rest) - partial_suffix(rest, _SEP)]
                    if rest and not _NAME.fullmatch(rest.strip()):
                        self.bad = not self.emitted
                    return events
                name = text[i:k].strip()
                if not _NAME.fullmatch(name):
                    self.bad = not self.emitted
                    return events
                self.emitted = True
                if self.max_calls is not None and self.next_index >= self.max_calls:
                    self.cur = -1
                else:
                    self.cur = self.next_index
                    self.next_index += 1
                    events.append(("call", self.cur, self.new_id(), name))
                self.args_at, self.sent = k + len(_ARGS), 0
            j = _skip_ws(text, self.args_at)
            if j >= len(text):
                return events
            if text[j] != "{":
                self.bad = not self.emitted
                return events
            if self.nest is None:
                self.nest = Nesting(j)
            end = self.nest.advance(text)
            stop = end if end is not None else rstrip_end(text, j)
            if self.cur >= 0 and stop - j > self.sent:
                events.append(("args", self.cur, text[j + self.sent:stop]))
                self.sent = stop - j
            if end is None:
                return events
            self.cur, self.pos, self.nest = None, end, None


class _MistralRegion:
    """Picks the format from the region's first character, then delegates."""

    def __init__(self, first_index: int, max_calls: int | None, new_id) -> None:
        self.args = (first_index, max_calls, new_id)
        self.inner: CallRegion | _NameArgsRegion | None = None

    @property
    def next_index(self) -> int:
        return self.args[0] if self.inner is None else self.inner.next_index

    @property
    def bad(self) -> bool:
        return self.inner is not None and self.inner.bad

    def update(self, text: str, complete: bool) -> list[Event]:
        if self.inner is None:
            head = text.lstrip()
            if not head:
                return []
            self.inner = (CallRegion if head[0] in "[{" else _NameArgsRegion)(*self.args)
        return self.inner.update(text, complete)


class MistralToolParser(MarkedCallsParser):
    name = "mistral"
    needs_special_tokens = True
    start = _SEP
    end = None
    new_id = staticmethod(short_call_id)

    def _open(self, prefix: str) -> None:
        super()._open(prefix)
        self.region = _MistralRegion(self.next_index, self.max_calls, self.new_id)
