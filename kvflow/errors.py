"""kvflow's own exception types.

Every error a user can cause raises one of these, with a message that says what to
change. The OpenAI server maps them to error bodies (``http_status`` and ``error_type``).
"""

from __future__ import annotations


class KvflowError(Exception):
    """Base class of every error kvflow raises on purpose."""

    http_status: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidParameterError(KvflowError, ValueError):
    """A request or engine parameter is outside its allowed range."""

    http_status = 400
    error_type = "invalid_request_error"


def require(ok: bool, param: str, message: str) -> None:
    """Raise InvalidParameterError("<param> <message>") unless ``ok``."""
    if not ok:
        raise InvalidParameterError(f"{param} {message}", param=param)


class PromptTooLongError(InvalidParameterError):
    """The prompt (plus the tokens it asks for) does not fit in the model or the cache."""


class ModelNotFoundError(KvflowError, FileNotFoundError):
    """The model name or path does not resolve to weights on this machine."""

    http_status = 404
    error_type = "not_found_error"


class ModelLoadError(KvflowError):
    """The model files exist but cannot be read (truncated, corrupt, unsupported)."""


class EngineDeadError(KvflowError):
    """The engine core stopped; no further requests can be served."""

    http_status = 503
    error_type = "service_unavailable"


class EngineNotReadyError(KvflowError):
    """The engine is still starting (model loading); the client should retry shortly."""

    http_status = 503
    error_type = "service_unavailable"


class RequestFailedError(KvflowError):
    """The engine could not run this request (a step failed on its data) and ended it;
    other requests and the engine went on."""


class RequestTimeoutError(KvflowError):
    """The request ran longer than the server's per-request timeout and was ended."""

    http_status = 504
    error_type = "timeout"


class QueueFullError(KvflowError):
    """The waiting queue is at its limit; the client should retry later."""

    http_status = 429
    error_type = "rate_limit_exceeded"


class OutOfMemoryError(KvflowError):
    """The device has too little memory for the requested configuration."""


class DistributedError(KvflowError):
    """A rank of a multi-process engine died, timed out or could not start; the engine
    cannot continue without it."""

    http_status = 503
    error_type = "service_unavailable"
