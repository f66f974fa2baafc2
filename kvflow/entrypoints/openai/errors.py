"""kvflow errors -> OpenAI error bodies: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvflow.errors import (EngineDeadError, EngineNotReadyError, InvalidParameterError,
                           KvflowError, ModelNotFoundError, PromptTooLongError,
                           QueueFullError)
from kvflow.logger import init_logger

logger = init_logger(__name__)

# Machine-readable codes where OpenAI has one (or an obvious one).
_CODES: tuple[tuple[type, str], ...] = (
    (PromptTooLongError, "context_length_exceeded"),
    (ModelNotFoundError, "model_not_found"),
    (QueueFullError, "queue_full"),
    (EngineNotReadyError, "engine_starting"),
    (EngineDeadError, "engine_dead"),
)


# Another API's error body, for the routes under a path prefix (the Anthropic routes):
# (status, message, error type, param, code) -> the JSON body.
ErrorShape = Callable[[int, str, str, "str | None", "str | int | None"], dict]


def shape_for(shapes: Mapping[str, ErrorShape] | None, path: str) -> ErrorShape | None:
    for prefix, shape in (shapes or {}).items():
        if path == prefix or path.startswith(prefix + "/"):
            return shape
    return None


def error_body(message: str, err_type: str, param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(status: int, message: str, err_type: str, param: str | None = None,
                   code: str | int | None = None, headers: dict | None = None
                   ) -> JSONResponse:
    return JSONResponse(error_body(message, err_type, param, code), status_code=status,
                        headers=headers)


def error_bytes(status: int, message: str, err_type: str, code: str | None = None,
                shape: ErrorShape | None = None) -> bytes:
    """The body of an error answered below FastAPI (the ASGI guard middleware)."""
    if shape is not None:
        return json.dumps(shape(status, message, err_type, None, code)).encode()
    return json.dumps(error_body(message, err_type, None, code)).encode()


def kvflow_error_code(e: KvflowError) -> str | None:
    for cls, code in _CODES:
        if isinstance(e, cls):
            return code
    return None


def kvflow_error_response(e: KvflowError) -> JSONResponse:
    status = e.http_status
    if status >= 500 and not isinstance(e, (EngineDeadError, EngineNotReadyError)):
        logger.error("internal error: %s", e.message)
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return error_response(status, e.message, e.error_type, e.param, kvflow_error_code(e),
                          headers)


def kvflow_error_sse(e: KvflowError) -> str:
    """An error inside a stream that already started (the status line is long gone)."""
    body = error_body(e.message, e.error_type, e.param, kvflow_error_code(e))
    return f"data: {json.dumps(body)}\n\n"


_TYPE_NAME = re.compile(r"^(constrained-)?(str|int|float|bool|bytes|dict|list|none|tuple|"
                        r"set|decimal)$")


def _is_branch(part: str) -> bool:
    """A union member's label in an error location (``str``, ``list[int]``, a tag)."""
    return any(c in part for c in "[]()") or bool(_TYPE_NAME.match(part))


def _validation_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    parts = [p for p in parts if not _is_branch(p)]
    return ".".join(parts) if parts else None


def _plain_type(label: str) -> str:
    """A union member's name without pydantic's validator wrappers:
    ``list[function-before[_integral(), int]]`` -> ``list[int]`` (the wrapped type is the
    wrapper's last argument)."""
    while (start := label.find("function-")) >= 0:
        open_at = label.find("[", start)
        depth, end, last = 0, open_at, open_at + 1
        for i in range(open_at, len(label)):
            if label[i] == "[":
                depth += 1
            elif label[i] == "]":
                depth -= 1
                if depth == 0:
                    end = i
                    break
            elif label[i] == "," and depth == 1:
                last = i + 1
        label = label[:start] + label[last:end].strip() + label[end + 1:]
    return label


def _branches(errs: list, param: str | None) -> list[str]:
    """The union members a field's value was tried against, as readable type names."""
    names = []
    for e in errs:
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        if _validation_param(tuple(loc)) is None or not (
                _validation_param(tuple(loc)) or "").startswith(param or ""):
            continue
        label = next((p for p in loc if _is_branch(p) and not p.startswith("[")), None)
        if label:
            label = _plain_type(label)
            label = re.sub(r"tagged-union\[.*\]", "object", label.replace("constrained-", ""))
            if label not in names:
                names.append(label)
    return names


def validation_error(errs: list) -> InvalidParameterError:
    """pydantic's validation errors as one kvflow error naming the parameter and what it
    allows. For a union (``stop``: a string or a list of strings), the error of the member
    the value's shape matched is the informative one; if it matched none, the message
    lists the members."""
    if not errs:
        return InvalidParameterError("invalid request")
    first = errs[0]
    param = _validation_param(tuple(first.get("loc", ())))
    if len(errs) > 1:
        same = [e for e in errs
                if (_validation_param(tuple(e.get("loc", ()))) or "").startswith(param or "")]
        deeper = [e for e in same if not str(e.get("type", "")).endswith("_type")]
        if deeper:
            first = deeper[0]
            param = _validation_param(tuple(first.get("loc", ())))
        elif len(_branches(same, param)) > 1 and param is not None:
            return InvalidParameterError(
                f"invalid type for {param!r}: expected one of "
                f"{', '.join(_branches(same, param))}", param=param)
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        message = f"unknown parameter: {param!r} is not a parameter of this endpoint"
    elif kind == "missing":
        message = f"missing required parameter: {param!r}"
    elif kind in ("json_invalid", "model_attributes_type", "dict_type") or param is None:
        message = f"the request body is not a valid JSON object: {first.get('msg')}"
        param = None
    else:
        msg = str(first.get("msg", "")).removeprefix("Value error, ")
        message = f"invalid value for {param!r}: {msg}"
    return InvalidParameterError(message, param=param)


def install_error_handlers(app: FastAPI,
                           shapes: Mapping[str, ErrorShape] | None = None) -> None:
    """OpenAI error bodies, except under the path prefixes of ``shapes``."""

    def reshape(request: Request, resp: JSONResponse) -> JSONResponse:
        shape = shape_for(shapes, request.url.path)
        if shape is None:
            return resp
        err = json.loads(resp.body)["error"]
        return JSONResponse(shape(resp.status_code, err["message"], err["type"],
                                  err["param"], err["code"]), status_code=resp.status_code,
                            headers={k: v for k, v in resp.headers.items()
                                     if k.lower() in ("retry-after", "www-authenticate")})

    @app.exception_handler(KvflowError)
    async def _kvflow(request: Request, e: KvflowError):
        return reshape(request, kvflow_error_response(e))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return reshape(request, kvflow_error_response(validation_error(e.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        err_type = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        code = "request_too_large" if e.status_code == 413 else None
        return reshape(request, error_response(e.status_code, str(e.detail), err_type,
                                               code=code))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        logger.exception("unhandled error in a request")
        return reshape(request, error_response(
            500, f"internal server error: {type(e).__name__}", "internal_error"))
