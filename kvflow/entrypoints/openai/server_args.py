"""Arguments of ``kvflow serve`` beyond the engine's (EngineArgs)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvflow import envs
from kvflow.errors import InvalidParameterError

MiB = 1 << 20


@dataclass(frozen=True)
class ServerArgs:
    """How the HTTP server listens and guards itself."""

    host: str = "127.0.0.1"
    """Address to bind; 127.0.0.1 keeps the server local (use 0.0.0.0 to expose it)."""
    port: int = 8000
    """TCP port."""
    api_key: str | None = None
    """When set, every route but /health needs 'Authorization: Bearer <key>'."""
    max_body_bytes: int = 8 * MiB
    """Largest request body accepted; larger ones get 413."""
    stats_log_interval: float = 5.0
    """Seconds between stats log lines while busy; 0 turns them off."""
    access_log: bool = False
    """Log one line per HTTP request (uvicorn's access log)."""
    uvicorn_log_level: str = "info"
    """uvicorn's own log level."""
    tokenizer_workers: int = 4
    """Threads that tokenize prompts and render chat templates."""
    shutdown_timeout: float = 30.0
    """On SIGINT/SIGTERM, how long in-flight responses may take to finish."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidParameterError(f"port must be in [0, 65535], got {self.port}",
                                        param="port")
        if self.max_body_bytes < 1024:
            raise InvalidParameterError("max_body_bytes must be at least 1024",
                                        param="max_body_bytes")
        if self.stats_log_interval < 0:
            raise InvalidParameterError("stats_log_interval must be >= 0",
                                        param="stats_log_interval")
        if self.tokenizer_workers < 1:
            raise InvalidParameterError("tokenizer_workers must be >= 1",
                                        param="tokenizer_workers")
        if self.shutdown_timeout < 0:
            raise InvalidParameterError("shutdown_timeout must be >= 0",
                                        param="shutdown_timeout")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        d = ServerArgs()
        g = parser.add_argument_group("server")
        g.add_argument("--host", default=d.host, help="address to bind (default "
                       "127.0.0.1: this machine only)")
        g.add_argument("--port", type=int, default=d.port, help="TCP port")
        g.add_argument("--api-key", default=None, help="require this key (Authorization: "
                       "Bearer KEY) on every route but /health; default: $KVFLOW_API_KEY")
        g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                       help="largest request body; larger ones get 413")
        g.add_argument("--stats-log-interval", type=float, default=d.stats_log_interval,
                       help="seconds between stats log lines while busy (0: off)")
        g.add_argument("--access-log", action=argparse.BooleanOptionalAction,
                       default=d.access_log, help="log every HTTP request")
        g.add_argument("--uvicorn-log-level", default=d.uvicorn_log_level,
                       choices=["critical", "error", "warning", "info", "debug", "trace"])
        g.add_argument("--tokenizer-workers", type=int, default=d.tokenizer_workers,
                       help="threads for tokenization and chat templates")
        g.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                       help="seconds in-flight responses get on SIGINT/SIGTERM")
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "ServerArgs":
        return cls(host=ns.host, port=ns.port, api_key=ns.api_key or envs.api_key(),
                   max_body_bytes=ns.max_body_bytes,
                   stats_log_interval=ns.stats_log_interval, access_log=ns.access_log,
                   uvicorn_log_level=ns.uvicorn_log_level,
                   tokenizer_workers=ns.tokenizer_workers,
                   shutdown_timeout=ns.shutdown_timeout)
