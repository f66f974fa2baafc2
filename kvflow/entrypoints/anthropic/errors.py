"""Errors in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``, the
error type following the HTTP status as Anthropic's API (and its client) pair them."""

from __future__ import annotations

import json

_TYPES = {400: "invalid_request_error", 401: "authentication_error",
          403: "permission_error", 404: "not_found_error", 413: "request_too_large",
          429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


def anthropic_error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")


def anthropic_error_body(status: int, message: str, err_type: str | None = None,
                         param: str | None = None, code: str | int | None = None) -> dict:
    """The body for an error of ``status`` (kvflow's own error type and code are
    OpenAI's vocabulary and are left out; the message names the field)."""
    return {"type": "error", "error": {"type": anthropic_error_type(status),
                                       "message": message}}


def anthropic_error_sse(status: int, message: str) -> bytes:
    """An error inside a stream that already started."""
    return (b"event: error\ndata: " + json.dumps(anthropic_error_body(status, message))
            .encode() + b"\n\n")
