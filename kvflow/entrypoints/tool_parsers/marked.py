"""Tool calls that follow a marker in the text (``<tool_call>``, ``[TOOL_CALLS]``,
``<|python_tag|>``): text outside the markers is content, the marked region is followed
by a CallRegion. A region that turns out not to be tool calls goes to content as written,
markers included."""

from __future__ import annotations

from kvflow.entrypoints.tool_parsers.base import (CallRegion, ContentSink, Event,
                                                  ToolParser, partial_suffix)


class MarkedCallsParser(ToolParser):
    start = ""
    """The marker that opens a run of tool calls."""
    end: str | None = None
    """The marker that closes it (None: the calls run to the end of the output)."""

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self.buf = ""           # text not yet handled
        self.sink = ContentSink()
        self.region: CallRegion | None = None
        self.region_text = ""
        self.region_prefix = ""  # what opened the region, given back if it is not calls
        self.next_index = 0
        self.passthrough = False

    def feed(self, delta: str) -> list[Event]:
        self.buf += delta
        return self._run(final=False)

    def finish(self) -> list[Event]:
        events = self._run(final=True)
        if self.region is not None:
            events += self._close(complete=True, closer="")
        return events + self.sink.finish()

    def _open(self, prefix: str) -> None:
        self.region = CallRegion(self.next_index, self.max_calls, self.new_id)
        self.region_text, self.region_prefix = "", prefix

    def _region_events(self, complete: bool, closer: str) -> list[Event]:
        """Update the open region; give it back as content if it is not tool calls."""
        region = self.region
        events = region.update(self.region_text, complete)
        if any(e[0] == "call" for e in events):
            self.sink.call()
        if region.bad:
            self.region = None
            raw = self.region_prefix + self.region_text + closer
            return events + self.sink.text(raw)
        return events

    def _close(self, complete: bool, closer: str) -> list[Event]:
        events = self._region_events(complete, closer)
        if self.region is not None:
            self.next_index = self.region.next_index
            self.region = None
        return events

    def _outside(self, final: bool) -> tuple[list[Event], bool]:
        """Content up to the next start marker; (events, whether a region opened)."""
        k = self.buf.find(self.start)
        if k < 0:
            keep = 0 if final else partial_suffix(self.buf, self.start)
            cut = len(self.buf) - keep
            events = self.sink.text(self.buf[:cut])
            self.buf = self.buf[cut:]
            return events, False
        events = self.sink.text(self.buf[:k])
        self.buf = self.buf[k + len(self.start):]
        self._open(self.start)
        return events, True

    def _run(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if self.passthrough:
                events += self.sink.text(self.buf)
                self.buf = ""
                return events
            if self.region is None:
                ev, opened = self._outside(final)
                events += ev
                if not opened:
                    return events
            if self.end is not None:
                k = self.buf.find(self.end)
                if k >= 0:
                    self.region_text += self.buf[:k]
                    self.buf = self.buf[k + len(self.end):]
                    events += self._close(complete=True, closer=self.end)
                    continue
                keep = 0 if final else partial_suffix(self.buf, self.end)
            else:
                keep = 0
            cut = len(self.buf) - keep
            self.region_text += self.buf[:cut]
            self.buf = self.buf[cut:]
            if final:
                return events  # finish() closes the region
            events += self._region_events(complete=False, closer="")
            if self.region is not None or not self.buf:
                return events
