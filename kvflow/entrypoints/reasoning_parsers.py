"""Reasoning parsers: the thinking a model writes between ``<think>`` and ``</think>``
becomes ``reasoning_content``, the rest ``content`` (``--reasoning-parser``).

- ``qwen3``: the output thinks when it opens with ``<think>``, or when the prompt already
  opened it (templates that end the generation prompt with ``<think>``); Qwen3 with
  ``enable_thinking: false`` renders an empty think block into the prompt, so its output
  is all content.
- ``deepseek_r1``: the output starts inside the reasoning whether or not it repeats the
  opening tag (R1's template puts it in the prompt); without ``</think>`` all of it is
  reasoning (the thinking was cut short).

Like the tool parsers these are incremental machines (``feed``/``finish`` return
("reasoning" | "content", text) events), so a stream and a whole response split alike.
"""

from __future__ import annotations

from kvflow.entrypoints.tool_parsers.base import partial_suffix
from kvflow.errors import InvalidParameterError

THINK_START, THINK_END = "<think>", "</think>"


class ReasoningParser:
    name = ""
    always_thinks = False

    def __init__(self, prompt: str = "") -> None:
        # "start": not yet known whether the output opens with <think>
        self.state = "start"
        self.opened_in_prompt = prompt.rstrip().endswith(THINK_START)
        self.buf = ""
        self.content_started = False

    @property
    def in_reasoning(self) -> bool:
        """Whether the text so far ends inside the reasoning (or may still open it)."""
        return self.state in ("start", "reasoning")

    def feed(self, delta: str) -> list[tuple[str, str]]:
        self.buf += delta
        return self._run(final=False)

    def finish(self) -> list[tuple[str, str]]:
        events = self._run(final=True)
        if self.buf:
            events.append(("reasoning" if self.state == "reasoning" else "content",
                           self.buf))
            self.buf = ""
        return events

    def _content(self, text: str) -> list[tuple[str, str]]:
        # The blank lines that follow </think> are not part of the answer.
        if not self.content_started:
            text = text.lstrip()
            if not text:
                return []
            self.content_started = True
        return [("content", text)]

    def _run(self, final: bool) -> list[tuple[str, str]]:
        events: list[tuple[str, str]] = []
        if self.state == "start":
            head = self.buf.lstrip()
            if not final and len(head) < len(THINK_START) and THINK_START.startswith(head):
                return events
            if head.startswith(THINK_START):
                self.buf = head[len(THINK_START):]
                self.state = "reasoning"
            elif self.opened_in_prompt or self.always_thinks:
                self.state = "reasoning"
            else:
                self.state = "content"
        if self.state == "reasoning":
            k = self.buf.find(THINK_END)
            if k < 0:
                keep = 0 if final else partial_suffix(self.buf, THINK_END)
                cut = len(self.buf) - keep
                if cut:
                    events.append(("reasoning", self.buf[:cut]))
                self.buf = self.buf[cut:]
                return events
            if k:
                events.append(("reasoning", self.buf[:k]))
            self.buf = self.buf[k + len(THINK_END):]
            self.state = "content"
        text, self.buf = self.buf, ""
        return events + self._content(text)


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    always_thinks = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
}


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise InvalidParameterError(
            f"unknown reasoning parser {name!r}; choose one of "
            f"{', '.join(sorted(REASONING_PARSERS))}", param="reasoning_parser") from None
