"""Small helpers every entry point that talks HTTP shares: the server (``kvflow serve``),
its benchmark client (``kvflow bench serve``) and the chat client (``kvflow chat --url``)."""

from __future__ import annotations

import resource
import socket


def raise_fd_limit() -> None:
    """Raise this process's open-file limit to its hard limit: every open connection is a
    file descriptor, and a benchmark at rate inf (or a server under one) opens thousands."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def normalize_base_url(url: str) -> str:
    """An OpenAI-compatible server's root URL, whether given as ``http://host:port``,
    ``http://host:port/``, ``http://host:port/v1`` (the form OpenAI clients take) or
    ``host:port`` (http assumed):
    routes are then ``base + "/v1/completions"``, ``base + "/metrics"`` ..."""
    base = url.strip().rstrip("/")
    if "://" not in base:  # "127.0.0.1:8000" or "localhost:8000", as curl takes them
        base = "http://" + base
    if base.endswith("/v1"):
        base = base[:-3]
    return base.rstrip("/")


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` and listening, for uvicorn to serve on. Bound by
    the server before anything else starts, so a port in use fails in a second with a
    message, not after the engine has loaded. Raises OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As uvicorn does: a restart may reuse a port whose old connections linger in
        # TIME_WAIT; a port another process listens on still fails.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock
