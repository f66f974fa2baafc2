"""Small helpers every entry point that talks HTTP shares: the server (``kvflow serve``),
its benchmark client (``kvflow bench serve``) and the chat client (``kvflow chat --url``)."""

from __future__ import annotations

import resource


def raise_fd_limit() -> None:
    """Raise this process's open-file limit to its hard limit: every open connection is a
    file descriptor, and a benchmark at rate inf (or a server under one) opens thousands."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def normalize_base_url(url: str) -> str:
    """An OpenAI-compatible server's root URL, whether given as ``http://host:port``,
    ``http://host:port/`` or ``http://host:port/v1`` (the form OpenAI clients take):
    routes are then ``base + "/v1/completions"``, ``base + "/metrics"`` ..."""
    base = url.strip().rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    return base.rstrip("/")
