"""Incremental detokenization and stop strings for streaming outputs.

Text is decoded from a short window of recent token ids (the classic prefix-offset /
read-offset scheme): each token costs one decode of a few ids, never a decode of the whole
output. A window whose text ends in U+FFFD holds a character whose UTF-8 bytes are split over
tokens (byte-level BPE, SentencePiece byte fallback); its text waits for the next token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial

from kvflow.engine.tokenizer import Tokenizer

# Prompt tokens decoded as context before the first output token, so the first token's text
# is what it is after the prompt (SentencePiece drops a leading space at the start of text).
_PROMPT_CONTEXT = 5
# Window length (tokens) after which the decode window restarts at the last clean point.
_MAX_WINDOW = 6
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sample's generated tokens into text, token by token, and finds stop strings.

    ``update`` consumes tokens and reports a matched stop string; ``get_next_output_text``
    says what text may be shown now. While the output runs, the last ``longest stop - 1``
    characters are held back, so no part of a stop string is ever shown before it is known
    not to be one. Not thread-safe: one instance belongs to one sample.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] | None, *,
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 stop: Iterable[str] = (), include_stop_str_in_output: bool = False,
                 min_tokens: int = 0) -> None:
        self.stop: tuple[str, ...] = tuple(s for s in stop if s)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.output_token_ids: list[int] = []
        self.stop_reason: str | None = None  # the stop string that ended the output
        # With the stop string kept in the output, nothing shown can ever be taken back.
        self._longest_stop = max((len(s) for s in self.stop), default=0)
        self._holdback = 0 if include_stop_str_in_output else max(self._longest_stop - 1, 0)
        self._decode: Callable[[list[int]], str] = _decoder(
            tokenizer, skip_special_tokens, spaces_between_special_tokens)
        # The decode window: _ids[:_read] decode to _prefix_len characters that end at a
        # whole character; later ids are still waiting for one.
        self._ids: list[int] = list(prompt_token_ids or ())[-_PROMPT_CONTEXT:]
        self._read = len(self._ids)
        self._prefix_len = len(self._decode(self._ids))
        self._parts: list[str] = []  # output text, in pieces (joined when read whole)
        self._len = 0
        self._sent = 0  # characters already returned by get_next_output_text

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def output_text(self) -> str:
        """All text decoded so far (truncated at a matched stop string)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def update(self, new_token_ids: Iterable[int]) -> str | None:
        """Add generated tokens; returns the stop string they completed, else None.

        On a match the text is cut at the stop string (kept when include_stop_str_in_output)
        and later tokens, in this call or after, are ignored.
        """
        if self.stop_reason is not None:
            return None
        for token_id in new_token_ids:
            self.output_token_ids.append(token_id)
            new = self._next_text(token_id)
            if not new:
                continue
            start = self._len
            self._parts.append(new)
            self._len += len(new)
            if (self.stop and len(self.output_token_ids) >= self.min_tokens
                    and self._check_stop(start)):
                return self.stop_reason
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to hand out now: all of it (delta=False) or only what is new (delta=True).

        While not finished, the tail that could still begin a stop string is withheld; when
        finished everything is released, including an incomplete last character (as U+FFFD,
        like a full decode shows it).
        """
        if finished and self.stop_reason is None and self._read < len(self._ids):
            rest = self._decode(self._ids)[self._prefix_len:]
            self._parts.append(rest)
            self._len += len(rest)
            self._read = len(self._ids)
        if finished or self.stop_reason is not None:
            length = self._len
        else:
            length = max(self._sent, self._len - self._holdback)
        start = self._sent if delta else 0
        self._sent = length
        if not delta:
            return self.output_text[:length]
        return self._text_range(start, length)

    # ---- internals -----------------------------------------------------------------------

    def _next_text(self, token_id: int) -> str:
        """Text the token completes ("" while a character is still incomplete)."""
        ids = self._ids
        ids.append(token_id)
        text = self._decode(ids)
        if len(text) <= self._prefix_len or text[-1] == _REPLACEMENT:
            return ""
        new = text[self._prefix_len:]
        if len(ids) > _MAX_WINDOW:
            # Restart the window at the previous clean point: one extra decode per window.
            del ids[:self._read]
            text = self._decode(ids)
        self._read = len(ids)
        self._prefix_len = len(text)
        return new

    def _text_range(self, start: int, end: int) -> str:
        """output_text[start:end] for a range near the end, without joining all the text."""
        got, i = 0, len(self._parts)
        while got < self._len - start and i > 0:
            i -= 1
            got += len(self._parts[i])
        tail = "".join(self._parts[i:])
        offset = self._len - got
        return tail[start - offset:end - offset]

    def _check_stop(self, new_start: int) -> bool:
        """Find a stop string that ends in the text after ``new_start``; cut the text there.

        Of several matches the one that ends first wins (then the longest): the one a reader
        of the text, character by character, meets first.
        """
        region_start = max(new_start - self._longest_stop + 1, 0)
        region = self._text_range(region_start, self._len)
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            i = region.find(s, max(new_start - len(s) + 1 - region_start, 0))
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is None:
            return False
        end, begin, s = best
        cut = region_start + (end if self.include_stop_str_in_output else begin)
        self._parts = [self.output_text[:cut]]
        self._len = cut
        self.stop_reason = s
        return True


def _decoder(tokenizer: Tokenizer, skip_special_tokens: bool,
             spaces_between_special_tokens: bool) -> Callable[[list[int]], str]:
    """The decode call for windows: straight to the Rust tokenizer unless spaces must go
    between kept special tokens."""
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and (skip_special_tokens or not spaces_between_special_tokens):
        return partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return partial(tokenizer.decode, skip_special_tokens=skip_special_tokens,
                   spaces_between_special_tokens=spaces_between_special_tokens)
