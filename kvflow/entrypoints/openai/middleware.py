"""ASGI guard in front of every route: API key (401) and request body size (413).

Pure ASGI (no BaseHTTPMiddleware) so streaming responses pass straight through.
"""

from __future__ import annotations

import base64
import binascii
import hmac

from starlette.exceptions import HTTPException

from kvflow.entrypoints.openai.errors import ErrorShape, error_bytes, shape_for

# Routes a load balancer or supervisor must reach without the key.
PUBLIC_PATHS = frozenset({"/health"})


class _BodyTooLarge(HTTPException):
    """Raised while the body streams in (chunked bodies have no Content-Length); FastAPI
    answers it through the HTTPException handler, or the guard does if it escapes."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, _too_large_message(limit))


def _too_large_message(limit: int) -> str:
    return (f"the request body is larger than the server's limit of {limit} bytes "
            f"(--max-body-bytes)")


class GuardMiddleware:
    def __init__(self, app, api_key: str | None, max_body_bytes: int,
                 shapes: dict[str, ErrorShape] | None = None) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.shapes = shapes  # path prefix -> another API's error body

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        shape = shape_for(self.shapes, scope["path"])
        if self.api_key is not None and scope["path"] not in PUBLIC_PATHS:
            if not self._authorized(headers):
                # A browser cannot send a Bearer token for a page: the dashboard asks for
                # the key as a Basic-auth password, which browsers prompt for.
                challenge = (b'Basic realm="kvflow", charset="UTF-8"'
                             if scope["path"].startswith("/dashboard") else b"Bearer")
                await _respond(send, 401, error_bytes(
                    401, "missing or incorrect API key: send it as 'Authorization: Bearer "
                    "<key>' or 'x-api-key: <key>'", "authentication_error", "invalid_api_key",
                    shape),
                    [(b"www-authenticate", challenge)])
                return
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_large = int(length) > self.max_body_bytes
            except ValueError:
                too_large = False
            if too_large:
                await self._too_large(send, shape)
                return
        started = False
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise _BodyTooLarge(self.max_body_bytes)
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await self._too_large(send, shape)

    def _authorized(self, headers: dict) -> bool:
        auth = headers.get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() == b"basic":  # any user name, the key as password (dashboard)
            try:
                token = base64.b64decode(token.strip(), validate=True).partition(b":")[2]
            except (binascii.Error, ValueError):
                token = b""
        elif scheme.lower() != b"bearer":
            token = headers.get(b"x-api-key", b"")
        return hmac.compare_digest(token.strip(), self.api_key)

    async def _too_large(self, send, shape: ErrorShape | None) -> None:
        await _respond(send, 413, error_bytes(
            413, _too_large_message(self.max_body_bytes), "invalid_request_error",
            "request_too_large", shape))


async def _respond(send, status: int, body: bytes, extra_headers=()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            *extra_headers]})
    await send({"type": "http.response.body", "body": body})
