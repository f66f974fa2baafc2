"""The base of every request model of the HTTP APIs: unknown fields refused (a 400 that
names them, as OpenAI does), no coercion between strings, numbers and booleans. Its own
module so that the request models built in other modules (structured outputs, pooling,
Responses) and protocol.py all import it from below."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
