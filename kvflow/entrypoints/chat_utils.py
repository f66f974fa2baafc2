"""Chat messages -> prompt: the one chat-template render that ``LLM.chat`` and the
server's chat and /tokenize routes share, with its limits in time and size."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Mapping
from typing import Any

from kvflow.errors import InvalidParameterError

# Variables the renderer itself sets; chat_template_kwargs may not replace them (a client
# overriding "messages" or picking its own "chat_template" would get past validation).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "add_generation_prompt", "chat_template", "max_chars", "bos_token",
    "eos_token", "pad_token", "unk_token"})


class _RenderTimeout(BaseException):
    """Raised inside the rendering thread when its time is up (a BaseException, so that
    the template's own error handling does not swallow it)."""


def check_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    kwargs = dict(kwargs or {})
    clash = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if clash:
        raise InvalidParameterError(
            f"chat_template_kwargs may not set {', '.join(repr(k) for k in clash)}: the "
            f"renderer sets {', '.join(sorted(RESERVED_TEMPLATE_KWARGS))} itself",
            param="chat_template_kwargs")
    return kwargs


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                template_kwargs: Mapping[str, Any] | None = None, *,
                timeout_s: float | None = None, max_chars: int | None = None,
                chat_template: str | None = None) -> tuple[str, list[int]]:
    """Render one conversation with the model's chat template; returns (prompt text,
    token ids). The template adds the special tokens, so encoding adds none.

    ``max_chars`` stops a rendering that grows past it; ``timeout_s`` stops one that runs
    longer (a template looping without output included): both raise
    InvalidParameterError, so a pathological template or conversation costs its request
    a 400 and the thread that rendered it nothing more. ``chat_template`` (a request's
    own, Jinja text or the name of one of the model's templates) replaces the model's.
    """
    if tokenizer is None:
        raise InvalidParameterError("chat needs a tokenizer and this model has none; send "
                                    "a completion prompt of token ids", param="messages")
    kwargs = check_template_kwargs(template_kwargs)

    def render() -> str:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=
                                             add_generation_prompt, max_chars=max_chars,
                                             chat_template=chat_template, **kwargs)

    text = render() if timeout_s is None else _with_deadline(render, timeout_s)
    return text, tokenizer.encode(text, add_special_tokens=False)


def _with_deadline(fn, timeout_s: float):
    """Run ``fn`` in this thread; if it is still running after ``timeout_s``, raise an
    exception inside it (templates are pure Python, so it lands within a few bytecodes)."""
    lock = threading.Lock()
    state = {"running": True}
    ident = threading.get_ident()

    def expire() -> None:
        with lock:
            if state["running"]:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident),
                                                           ctypes.py_object(_RenderTimeout))

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    try:
        timer.start()
        try:
            return fn()
        finally:
            with lock:
                state["running"] = False
            timer.cancel()
    except _RenderTimeout:
        raise InvalidParameterError(f"the chat template took longer than {timeout_s:g} s to "
                                    f"render these messages", param="messages") from None
