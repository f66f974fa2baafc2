"""Arguments of ``kvflow serve`` beyond the engine's (EngineArgs)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from kvflow import envs
from kvflow.entrypoints.reasoning_parsers import reasoning_parser_class
from kvflow.entrypoints.tool_parsers import tool_parser_class
from kvflow.errors import InvalidParameterError

MiB = 1 << 20


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds an operator may want to move (``kvflow serve`` options)."""

    max_n: int = 128
    """Most samples per request (``n``, ``best_of``): each is a sequence in the batch."""
    max_stop: int = 16
    """Most stop strings, and most stop token ids, per request."""
    max_stop_length: int = 256
    """Longest stop string in characters (each costs string matching on every delta)."""
    max_logit_bias: int = 300
    """Most logit_bias entries (OpenAI's limit)."""
    max_messages: int = 2048
    """Most messages in one chat request."""
    max_prompts: int = 256
    """Most prompts in one completion request (a list of prompts)."""
    max_structured_chars: int = 100_000
    """Longest JSON schema (compact JSON), regex or grammar in response_format /
    structured_outputs, in characters."""
    max_structured_depth: int = 32
    """Deepest nesting of a JSON schema (objects and lists)."""
    max_structured_choices: int = 2000
    """Most choices in structured_outputs.choice, and most values in one schema enum."""

    def __post_init__(self) -> None:
        for name in ("max_n", "max_stop", "max_stop_length", "max_logit_bias",
                     "max_messages", "max_prompts", "max_structured_chars",
                     "max_structured_depth", "max_structured_choices"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidParameterError(f"{name} must be an integer >= 1, got {value!r}",
                                            param=name)


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
    request_timeout: float | None = None
    """Longest a generation request may take, queueing included; past it the request is
    aborted and answered 504 (inside a stream: an error event). None: no limit."""
    chat_template_timeout: float = 5.0
    """Longest a chat template may take to render one request's messages (400 past it)."""
    max_chat_prompt_chars: int = 4 * MiB
    """Longest prompt a chat template may render, in characters (400 past it)."""
    responses_store_size: int = 1024
    """Most Responses API responses kept in memory (LRU) for GET /v1/responses/{id} and
    previous_response_id; 0 stores none."""
    limits: RequestLimits = field(default_factory=RequestLimits)
    """Per-request bounds (samples, stop strings, logit_bias entries, messages, prompts)."""
    tool_call_parser: str | None = None
    """How the model writes tool calls: hermes, llama3_json or mistral. None: detected
    from the chat template (hermes for templates without tools: the default tool prompt
    asks for it)."""
    reasoning_parser: str | None = None
    """Split the model's thinking into reasoning_content: qwen3 or deepseek_r1. None: all
    of the output is content."""

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
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise InvalidParameterError("request_timeout must be > 0 (or not given)",
                                        param="request_timeout")
        if not self.chat_template_timeout > 0:
            raise InvalidParameterError("chat_template_timeout must be > 0",
                                        param="chat_template_timeout")
        if self.responses_store_size < 0:
            raise InvalidParameterError("responses_store_size must be >= 0",
                                        param="responses_store_size")
        if self.tool_call_parser is not None:
            tool_parser_class(self.tool_call_parser)
        if self.reasoning_parser is not None:
            reasoning_parser_class(self.reasoning_parser)
        if self.max_chat_prompt_chars < 1:
            raise InvalidParameterError("max_chat_prompt_chars must be >= 1",
                                        param="max_chat_prompt_chars")

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
        g.add_argument("--request-timeout", type=float, default=d.request_timeout,
                       help="seconds a generation request may take, queueing included "
                       "(504 past it; default: no limit)")
        g.add_argument("--chat-template-timeout", type=float, default=d.chat_template_timeout,
                       help="seconds a chat template may take to render (400 past it)")
        g.add_argument("--max-chat-prompt-chars", type=int, default=d.max_chat_prompt_chars,
                       help="longest prompt a chat template may render, in characters")
        g.add_argument("--responses-store-size", type=int, default=d.responses_store_size,
                       help="Responses API responses kept in memory for previous_response_id "
                       "and GET /v1/responses/{id} (least recently used out; 0: none)")
        g.add_argument("--tool-call-parser", default=None,
                       choices=["hermes", "llama3_json", "mistral"],
                       help="how the model writes tool calls (default: detected from the "
                       "chat template; hermes for templates without tools)")
        g.add_argument("--reasoning-parser", default=None,
                       choices=["qwen3", "deepseek_r1"],
                       help="split <think>...</think> into reasoning_content")
        lim = d.limits
        g.add_argument("--max-n", type=int, default=lim.max_n,
                       help="most samples per request (n, best_of)")
        g.add_argument("--max-stop", type=int, default=lim.max_stop,
                       help="most stop strings (and most stop token ids) per request")
        g.add_argument("--max-stop-length", type=int, default=lim.max_stop_length,
                       help="longest stop string, in characters")
        g.add_argument("--max-logit-bias", type=int, default=lim.max_logit_bias,
                       help="most logit_bias entries per request")
        g.add_argument("--max-messages", type=int, default=lim.max_messages,
                       help="most messages per chat request")
        g.add_argument("--max-prompts", type=int, default=lim.max_prompts,
                       help="most prompts per completion request")
        g.add_argument("--max-structured-chars", type=int, default=lim.max_structured_chars,
                       help="longest JSON schema, regex or grammar of a constrained request")
        g.add_argument("--max-structured-depth", type=int, default=lim.max_structured_depth,
                       help="deepest nesting of a JSON schema in a request")
        g.add_argument("--max-structured-choices", type=int,
                       default=lim.max_structured_choices,
                       help="most choices (structured_outputs.choice) and most enum values")
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "ServerArgs":
        return cls(host=ns.host, port=ns.port, api_key=ns.api_key or envs.api_key(),
                   max_body_bytes=ns.max_body_bytes,
                   stats_log_interval=ns.stats_log_interval, access_log=ns.access_log,
                   uvicorn_log_level=ns.uvicorn_log_level,
                   tokenizer_workers=ns.tokenizer_workers,
                   shutdown_timeout=ns.shutdown_timeout, request_timeout=ns.request_timeout,
                   chat_template_timeout=ns.chat_template_timeout,
                   max_chat_prompt_chars=ns.max_chat_prompt_chars,
                   responses_store_size=ns.responses_store_size,
                   tool_call_parser=ns.tool_call_parser,
                   reasoning_parser=ns.reasoning_parser,
                   limits=RequestLimits(max_n=ns.max_n, max_stop=ns.max_stop,
                                        max_stop_length=ns.max_stop_length,
                                        max_logit_bias=ns.max_logit_bias,
                                        max_messages=ns.max_messages,
                                        max_prompts=ns.max_prompts,
                                        max_structured_chars=ns.max_structured_chars,
                                        max_structured_depth=ns.max_structured_depth,
                                        max_structured_choices=ns.max_structured_choices))
