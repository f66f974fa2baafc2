"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncEngine.

``kvflow serve [MODEL]`` runs it with uvicorn on 127.0.0.1:8000. The engine core starts
in the background: /health answers 503 until the model is loaded, 200 while it serves,
and 503 again if the engine core dies (the server then exits non-zero).
"""

# No "from __future__ import annotations": the routes' body types are built per app
# (request_models) and FastAPI must see them as objects, not names.

import asyncio
import dataclasses
import signal
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Annotated

import uvicorn
from fastapi import Body, FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi

from kvflow.version import __version__
from kvflow.config import GiB
from kvflow.engine.async_client import AsyncEngine, CoreProcess, EngineState
from kvflow.engine.smooth_steps import smooth_on_cpu
from kvflow.engine.stats import LoggingStatsListener
from kvflow.entrypoints.openai.dashboard import install_dashboard
from kvflow.entrypoints.openai.docs_page import install_docs
from kvflow.entrypoints.openai.errors import (error_response, install_error_handlers,
                                              kvflow_error_response)
from kvflow.entrypoints.openai.metrics import CONTENT_TYPE, PrometheusMetrics
from kvflow.entrypoints.openai.middleware import GuardMiddleware
from kvflow.entrypoints.openai.protocol import (ChatCompletionResponse, CompletionResponse,
                                                DetokenizeResponse, ErrorResponse, ModelCard,
                                                ModelList, TokenizeResponse, request_models)
from kvflow.entrypoints.openai.server_args import ServerArgs
from kvflow.entrypoints.openai.serving import ClientDisconnected, json_response
from kvflow.entrypoints.openai.serving_chat import ChatServing
from kvflow.entrypoints.openai.serving_completion import CompletionServing
from kvflow.entrypoints.openai.serving_pooling import PoolingServing, add_pooling_routes
from kvflow.entrypoints.openai.serving_responses import add_responses_routes
from kvflow.entrypoints.anthropic.errors import anthropic_error_body
from kvflow.entrypoints.anthropic.serving import add_anthropic_routes
from kvflow.entrypoints.utils import listen_socket, raise_fd_limit
from kvflow.errors import InvalidParameterError, KvflowError
from kvflow.logger import init_logger

logger = init_logger(__name__)

# After the engine core dies, /health answers 503 this long before the server exits, so
# a load balancer or supervisor polling it sees why.
DEAD_EXIT_DELAY_S = 2.0
# HTTP status for a request whose client went away (nginx's convention; nobody reads it).
CLIENT_CLOSED = 499
# Waiting requests beyond which the server answers 429 when --max-queued-requests is not
# given: a burst beyond it gets told to come back instead of piling up without bound.
DEFAULT_MAX_QUEUED_REQUESTS = 1024


def _error_responses(*statuses: int) -> dict:
    """OpenAPI entries for the error statuses a route answers (OpenAI's error body)."""
    return {status: {"model": ErrorResponse} for status in statuses}


def _generation_responses(model) -> dict:
    return {200: {"model": model, "description": "the response; with stream: true, "
                  "server-sent events of chunks ending in data: [DONE]",
                  "content": {"text/event-stream": {}}},
            **_error_responses(400, 401, 404, 413, 429, 500, 503, 504)}


class ServerState:
    """Everything the routes share, owned by one app (no module globals)."""

    def __init__(self, engine: AsyncEngine, args: ServerArgs,
                 request_exit: Callable[[int], None], start_time: float) -> None:
        self.engine = engine
        self.args = args
        self.request_exit = request_exit
        self.start_time = start_time
        self.model_name = engine.config.model.name
        self.metrics = PrometheusMetrics(self.model_name)
        self.stats_logger = LoggingStatsListener(args.stats_log_interval)
        self.completions = CompletionServing(engine, self.model_name, args)
        self.chat = ChatServing(engine, self.model_name, args)
        self.pooling = PoolingServing(engine, self.model_name, args)
        self.loras = None  # LoRARegistry with --enable-lora (kvflow/lora/registry.py)
        if engine.config.lora is not None:
            from kvflow.lora.registry import LoRARegistry

            self.loras = LoRARegistry(engine.config)
            for name, path in engine.config.lora.lora_modules:  # a bad one stops the start
                self.loras.load(name, path)
            self.completions.loras = self.chat.loras = self.loras
        self.created = int(time.time())
        self.routes: list[str] = []  # "METHOD /path", filled in once the app has them
        engine.add_stats_listener(self.metrics)
        engine.add_stats_listener(self.stats_logger)
        engine.add_death_listener(self._on_engine_death)

    def _on_engine_death(self, cause: str) -> None:
        logger.error("the engine core is gone: /health answers 503; exiting in %.0f s",
                     DEAD_EXIT_DELAY_S)
        asyncio.get_running_loop().call_later(DEAD_EXIT_DELAY_S, self.request_exit, 1)

    async def start_engine(self) -> None:
        m = self.engine.config.model
        logger.info("starting the engine core for %s (%s); /health answers 503 until it "
                    "is ready", m.name, m.load_format)
        try:
            await self.engine.start()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if self.engine.state is not EngineState.DEAD:  # a death is logged already
                logger.error("the engine failed to start: %s", e)
            self.request_exit(1)
            return
        self._log_ready()

    def _log_ready(self) -> None:
        ready, cfg, args = self.engine.ready, self.engine.config, self.args
        m = cfg.model
        tokens = ready.num_blocks * ready.block_size
        logger.info("model %s: %s weights, dtype %s, device %s, max_model_len %d, "
                    "tokenizer: %s; engine core pid %d", m.name, m.load_format, ready.dtype,
                    ready.device, ready.max_model_len,
                    "yes" if self.engine.tokenizer else "none", ready.pid)
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB; maximum "
                    "concurrency at max_model_len %d: %.2fx", ready.num_blocks,
                    ready.block_size, tokens, ready.kv_cache_bytes / GiB,
                    ready.max_model_len, tokens / ready.max_model_len)
        logger.info("%s (a request's own values win)", m.generation_defaults_line())
        logger.info("routes: %s", ", ".join(self.routes))
        logger.info("kvflow %s serving %s at http://%s:%d%s - ready in %.1f s", __version__,
                    m.name, args.host, args.port,
                    " (API key required)" if args.api_key else "",
                    time.monotonic() - self.start_time)

    async def log_loop(self) -> None:
        while True:
            await asyncio.sleep(self.args.stats_log_interval)
            self.stats_logger.log(time.monotonic())


def build_app(engine: AsyncEngine, args: ServerArgs, request_exit: Callable[[int], None],
              start_time: float | None = None) -> FastAPI:
    state = ServerState(engine, args, request_exit,
                        time.monotonic() if start_time is None else start_time)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        tasks = [asyncio.create_task(state.start_engine())]
        if args.stats_log_interval > 0:
            tasks.append(asyncio.create_task(state.log_loop()))
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await engine.shutdown()
            logger.info("engine stopped")

    # /openapi.json and /docs sit behind the API key like every route but /health.
    app = FastAPI(title="kvflow", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API of kvflow (see docs/serving.md)",
                  docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    install_docs(app)  # /docs from local assets: works offline
    app.state.kvflow = state
    app.openapi = lambda: _openapi(app)
    # The Anthropic routes answer errors in Anthropic's shape.
    shapes = {"/v1/messages": anthropic_error_body}
    install_error_handlers(app, shapes)
    app.add_middleware(GuardMiddleware, api_key=args.api_key,
                       max_body_bytes=args.max_body_bytes, shapes=shapes)
    _add_routes(app, state)
    state.responses = add_responses_routes(app, state)
    state.messages = add_anthropic_routes(app, state)
    install_dashboard(app, engine, state.model_name)
    state.routes = [f"{method} {route.path}" for route in app.routes
                    for method in sorted(getattr(route, "methods", ()) or ()) if method != "HEAD"]
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema without its 422 entries: validation errors here are OpenAI's 400
    (the error handlers), which every route documents instead."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version,
                             description=app.description, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def _add_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

    models = request_models(state.args.limits)
    CompletionRequest, ChatCompletionRequest = models.completion, models.chat
    TokenizeRequest, DetokenizeRequest = models.tokenize, models.detokenize

    @app.get("/health", responses=_error_responses(503))
    async def health():
        if engine.state is EngineState.READY:
            return {"status": "ok"}
        try:
            engine.check_ready()
        except KvflowError as e:
            return kvflow_error_response(e)
        return error_response(503, "the engine is not ready", "service_unavailable")

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE.split(";")[0]: {}}}})
    async def metrics():
        if state.loras is not None:
            state.metrics.lora_adapters.set(len(state.loras.names()))
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    def model_card() -> ModelCard:
        m = engine.config.model
        return ModelCard(id=state.model_name, created=state.created, root=m.path or m.model,
                         max_model_len=m.max_model_len,
                         generation_defaults=dict(m.generation_defaults),
                         generation_source=m.generation_source,
                         max_tokens_default=m.max_tokens_default,
                         repetition_guard=m.repetition_guard,
                         determinism=engine.ready.determinism or None,
                         determinism_why=engine.ready.determinism_why or None,
                         system_fingerprint=engine.ready.fingerprint or None)

    if state.loras is not None and engine.config.lora.allow_runtime_updating:
        from kvflow.entrypoints.openai.lora_routes import add_lora_routes

        add_lora_routes(app, state.loras)

    @app.get("/v1/models", response_model=ModelList)
    async def models_route():
        cards = [model_card()]
        if state.loras is not None:
            from kvflow.entrypoints.openai.lora_routes import lora_model_cards

            cards += lora_model_cards(state.loras, state.created, state.model_name,
                                      engine.config.model.max_model_len)
        return json_response(ModelList(data=cards))

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard,
             responses=_error_responses(401, 404))
    async def model(model_id: str):
        lora = state.completions.check_model(model_id)
        if lora is not None:  # an adapter: a model of its own, with the base as parent
            return json_response(ModelCard(
                id=lora.lora_name, created=state.created, root=lora.lora_path,
                parent=state.model_name, max_model_len=engine.config.model.max_model_len))
        return json_response(model_card())

    @app.post("/v1/completions", response_model=None,
              responses=_generation_responses(CompletionResponse))
    async def completions(body: CompletionRequest, raw: Request):
        try:
            state.pooling.check_generates()
            return await state.completions.create(body, raw)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)

    @app.post("/v1/chat/completions", response_model=None,
              responses=_generation_responses(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        try:
            state.pooling.check_generates()
            return await state.chat.create(body, raw)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)

    add_pooling_routes(app, state.pooling, state.args.limits,
                       _error_responses(400, 401, 404, 413, 429, 500, 503, 504))

    def tokenizer():
        engine.check_ready()
        if engine.tokenizer is None:
            raise InvalidParameterError("this model has no tokenizer")
        return engine.tokenizer

    @app.post("/tokenize", response_model=TokenizeResponse,
              responses=_error_responses(400, 401, 404, 413, 503))
    async def tokenize(body: Annotated[TokenizeRequest, Body()]):
        state.completions.check_model(body.model)
        tok = tokenizer()
        if isinstance(body, models.tokenize_chat):
            _, ids, _ = await state.chat.render_request(body)
        else:
            ids = await engine.run_in_pool(tok.encode, body.prompt, body.add_special_tokens)
        return json_response(TokenizeResponse(
            count=len(ids), max_model_len=engine.config.model.max_model_len, tokens=ids,
            token_strs=tok.convert_ids_to_tokens(ids)))

    @app.post("/detokenize", response_model=DetokenizeResponse,
              responses=_error_responses(400, 401, 404, 413, 503))
    async def detokenize(body: DetokenizeRequest):
        state.completions.check_model(body.model)
        tok = tokenizer()
        vocab = engine.config.model.arch.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidParameterError(f"token ids must be in [0, {vocab}), got {bad[0]}",
                                        param="tokens")
        text = await engine.run_in_pool(tok.decode, body.tokens)
        return json_response(DetokenizeResponse(prompt=text))


# `kvflow serve` exit code when --host/--port cannot be bound (in use, not allowed): the
# engine was not started. (uvicorn's own start-up failure code, now documented.)
EXIT_CANNOT_LISTEN = 3


def run_server(engine_args, server_args: ServerArgs) -> int:
    """Serve until SIGINT/SIGTERM (exit 0) or until the engine core dies (exit 1); exit
    EXIT_CANNOT_LISTEN (3) when the address cannot be bound, before anything starts."""
    start = time.monotonic()
    raise_fd_limit()
    try:
        sock = listen_socket(server_args.host, server_args.port)
    except OSError as e:
        logger.error("cannot listen on %s:%d: %s (is another server running there? pick "
                     "another --port)", server_args.host, server_args.port,
                     e.strerror or e)
        return EXIT_CANNOT_LISTEN
    if engine_args.max_queued_requests is None:
        engine_args = dataclasses.replace(engine_args,
                                          max_queued_requests=DEFAULT_MAX_QUEUED_REQUESTS)
    engine_args = smooth_on_cpu(engine_args)  # bounded steps on CPU (engine/smooth_steps.py)
    # The core's start-up (imports, model load) overlaps this process's own.
    try:
        core = CoreProcess(engine_args)
    except BaseException:
        sock.close()
        raise
    try:
        config = engine_args.create_engine_config()
    except BaseException:
        core.close()
        sock.close()
        raise
    engine = AsyncEngine(engine_args, config, tokenizer_workers=server_args.tokenizer_workers,
                         core=core)
    exit_code = [0]
    holder: list[uvicorn.Server] = []

    def request_exit(code: int) -> None:
        exit_code[0] = max(exit_code[0], code)
        if holder:
            holder[0].should_exit = True

    app = build_app(engine, server_args, request_exit, start)
    server = _Server(uvicorn.Config(
        app, host=server_args.host, port=server_args.port,
        log_level=server_args.uvicorn_log_level, access_log=server_args.access_log,
        timeout_graceful_shutdown=server_args.shutdown_timeout, lifespan="on"))
    holder.append(server)
    grace = server_args.shutdown_timeout

    def drain() -> None:
        # Just before uvicorn's grace period ends (when it would cancel the responses
        # mid-body, logging a traceback for each), end the streams still running.
        engine.call_soon_threadsafe(
            lambda: asyncio.get_running_loop().call_later(
                max(0.0, grace - DRAIN_MARGIN_S), engine.end_streams,
                f"the server is shutting down and this request did not finish within the "
                f"shutdown grace period (--shutdown-timeout {grace:g} s)"))

    server.on_exit = drain
    with sock:
        server.run(sockets=[sock])
    if not server.started and exit_code[0] == 0:
        exit_code[0] = 1  # e.g. the port was taken
    return exit_code[0]


# Streams still running this long before the shutdown grace period ends are ended by the
# server (an error event, then [DONE]) so they close before uvicorn cuts them.
DRAIN_MARGIN_S = 1.0


class _Server(uvicorn.Server):
    """Ends a signalled shutdown with a normal return (exit 0); uvicorn itself re-raises
    the signal once it has shut down."""

    on_exit: Callable[[], None] | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:  # a second Ctrl-C: stop waiting
            self.force_exit = True
        else:
            logger.info("%s: shutting down gracefully", signal.Signals(sig).name)
            if not self.should_exit and self.on_exit is not None:
                self.on_exit()
            self.should_exit = True
