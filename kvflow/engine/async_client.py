"""AsyncEngine: the server's handle on an engine core that runs in its own process.

The API process keeps everything that touches text: the InputProcessor (tokenization and
chat templates run in a thread pool, so the event loop never blocks on them) and the
OutputProcessor (incremental detokenization and stop strings, done as each step's token
ids arrive). The engine-core process only schedules and runs the model; the two talk
through typed messages (kvflow.engine.messages) over ZMQ ipc sockets in a private
directory. Tokenization, detokenization and HTTP thus overlap with model execution.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import zmq
import zmq.asyncio

from kvflow import errors
from kvflow.config import EngineConfig
from kvflow.engine.args import EngineArgs
from kvflow.engine.messages import (Abort, AddRequest, CoreStats, EngineError, FinishStopped,
                                    Outputs, Ready, RequestError, RequestFailed, Shutdown,
                                    Stats, api_codec)
from kvflow.engine.output_processor import OutputProcessor
from kvflow.engine.processor import InputProcessor, PromptType, child_request_id
from kvflow.engine.stats import IterationStats, SequenceTracker, StatsListener
from kvflow.errors import (EngineDeadError, EngineNotReadyError, InvalidParameterError,
                           KvflowError)
from kvflow.logger import init_logger
from kvflow.outputs import CompletionOutput, RequestOutput
from kvflow.sampling_params import OutputKind, SamplingParams
from kvflow.utils import describe_exit

logger = init_logger(__name__)

# How long a shutting-down engine core may take before it is killed.
SHUTDOWN_TIMEOUT_S = 10.0


class EngineState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DEAD = "dead"  # the core process died or failed to start
    STOPPED = "stopped"  # shut down on purpose


class _Aborted:
    """Stream marker: the request was aborted from outside its generator."""


_ABORTED = _Aborted()


class _RequestStream:
    """What the engine produced for one request and its consumer has not taken yet."""

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._ready = asyncio.Event()

    def put(self, item) -> None:
        self._items.append(item)
        self._ready.set()

    async def get_all(self) -> list:
        """Everything waiting, in order; waits while there is nothing."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        items = list(self._items)
        self._items.clear()
        return items


def merge_outputs(a: RequestOutput, b: RequestOutput, kind: OutputKind) -> RequestOutput:
    """One output carrying what ``a`` and then ``b`` (the next output of the same request)
    carry: deltas are concatenated, cumulative outputs simply replaced by the later one."""
    if kind is not OutputKind.DELTA:
        return b
    samples = {c.index: c for c in a.outputs}
    for c in b.outputs:
        prev = samples.get(c.index)
        if prev is None:
            samples[c.index] = c
            continue
        logprobs = prev.logprobs
        if c.logprobs is not None:
            logprobs = (logprobs or []) + c.logprobs
        samples[c.index] = CompletionOutput(
            index=c.index, text=prev.text + c.text, token_ids=prev.token_ids + c.token_ids,
            cumulative_logprob=c.cumulative_logprob, logprobs=logprobs,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason)
    return RequestOutput(
        request_id=b.request_id, prompt=b.prompt, prompt_token_ids=b.prompt_token_ids,
        outputs=[samples[i] for i in sorted(samples)], finished=b.finished,
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None
        else b.prompt_logprobs, metrics=b.metrics,
        num_cached_tokens=max(a.num_cached_tokens, b.num_cached_tokens), extra=b.extra)


def _error_from_core(msg: RequestError) -> KvflowError:
    cls = getattr(errors, msg.error_class, None)
    if not (isinstance(cls, type) and issubclass(cls, KvflowError)):
        cls = KvflowError
    return cls(msg.message, param=msg.param)


def _exit_cause(returncode: int) -> str:
    return describe_exit("the engine core process", returncode)


class CoreProcess:
    """The engine-core subprocess and the two ZMQ sockets to it.

    Starting it needs only the engine arguments, so a server can start it first and let
    the core's start-up (imports, model loading) overlap its own.
    """

    def __init__(self, engine_args: EngineArgs) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix="kvflow-")  # mode 0700: ours alone
        os.chmod(self.ipc_dir, 0o700)
        in_addr = f"ipc://{self.ipc_dir}/input"
        out_addr = f"ipc://{self.ipc_dir}/output"
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDHWM, 0)
        self.input.bind(in_addr)
        self.output = self.ctx.socket(zmq.PULL)
        self.output.setsockopt(zmq.RCVHWM, 0)
        self.output.bind(out_addr)
        cmd = [sys.executable, "-m", "kvflow.engine.core_proc", "--input", in_addr,
               "--output", out_addr, "--engine-args", json.dumps(asdict(engine_args))]
        # Its own session: signals meant for the server's process group (Ctrl-C, timeout,
        # kill -TERM -PGID) reach the API process, which then stops the core in order.
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)

    def close(self) -> None:
        """Kill the process if it still runs, close the sockets, remove the directory."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


class AsyncEngine:
    """Start with ``await start()``; then ``generate(...)`` from any number of tasks."""

    def __init__(self, engine_args: EngineArgs, config: EngineConfig, *,
                 tokenizer_workers: int = 4, core: CoreProcess | None = None) -> None:
        """``core``: an engine-core process already started with ``engine_args``."""
        self.engine_args = engine_args
        self.config = config
        self.state = EngineState.STARTING
        self.dead_cause: str | None = None
        self.ready: Ready | None = None
        self.core_stats: CoreStats | None = None
        self.tokenizer = None
        self.processor: InputProcessor | None = None
        self.output_processor: OutputProcessor | None = None
        self._pool = ThreadPoolExecutor(max_workers=tokenizer_workers,
                                        thread_name_prefix="kvflow-tokenize")
        self._codec = api_codec()
        self._streams: dict[str, _RequestStream] = {}
        self._tracker = SequenceTracker()
        self._stats_listeners: list[StatsListener] = []
        self._death_listeners: list[Callable[[str], None]] = []
        self._core_error: str | None = None
        self._core = core
        self._output: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._ready_future: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- life cycle ---------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine-core process and wait until it is ready (or raise why not)."""
        self._loop = asyncio.get_running_loop()
        self._ready_future = self._loop.create_future()
        if self._core is None:
            self._core = CoreProcess(self.engine_args)
        self._output = zmq.asyncio.Socket.from_socket(self._core.output)
        self._reader = asyncio.ensure_future(self._read_outputs())
        threading.Thread(target=self._watch, args=(self._core.proc,), name="kvflow-watchdog",
                         daemon=True).start()
        tokenizer_task = self._loop.run_in_executor(self._pool, self._load_tokenizer)
        try:
            ready = await self._ready_future
            self.tokenizer = await tokenizer_task
        except BaseException:
            await self.shutdown()
            raise
        self.processor = InputProcessor(self.config, self.tokenizer, ready.num_blocks)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.ready = ready
        if self.state is EngineState.STARTING:
            self.state = EngineState.READY

    def _load_tokenizer(self):
        if self.config.model.tokenizer is None:
            return None
        from kvflow.engine.tokenizer import Tokenizer

        return Tokenizer.from_path(self.config.model.tokenizer).with_chat_template(
            self.config.model.chat_template)

    def _watch(self, proc: subprocess.Popen) -> None:
        """Watchdog thread: wait for the core process to exit, then tell the loop."""
        rc = proc.wait()
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._on_core_exit, rc)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _on_core_exit(self, returncode: int) -> None:
        if self.state is EngineState.STOPPED:
            return
        self._drain_sync()  # an EngineError sent just before the exit says why
        cause = self._core_error or _exit_cause(returncode)
        if self._core_error:
            cause = f"{cause} ({_exit_cause(returncode)})"
        self._die(cause)

    def _die(self, cause: str) -> None:
        if self.state in (EngineState.DEAD, EngineState.STOPPED):
            return
        self.state = EngineState.DEAD
        self.dead_cause = cause
        logger.error("engine core died: %s", cause)
        if self._ready_future is not None and not self._ready_future.done():
            self._ready_future.set_exception(EngineDeadError(f"engine core failed to start: "
                                                             f"{cause}"))
        for q in self._streams.values():
            q.put(EngineDeadError(f"the engine stopped: {cause}"))
        for listener in list(self._death_listeners):
            listener(cause)

    async def shutdown(self) -> None:
        """Stop the engine core (gracefully, then by force) and release everything."""
        graceful = self.state in (EngineState.READY, EngineState.STARTING)
        if self.state is not EngineState.DEAD:
            self.state = EngineState.STOPPED
        core = self._core
        if core is not None and core.proc.poll() is None:
            if graceful:
                self._send(Shutdown())
            else:
                core.proc.terminate()
            try:
                await asyncio.get_running_loop().run_in_executor(
                    None, core.proc.wait, SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("engine core did not stop in %.0f s; killing it",
                               SHUTDOWN_TIMEOUT_S)
        if self._reader is not None:
            self._reader.cancel()
        for q in self._streams.values():
            q.put(EngineDeadError("the server is shutting down"))
        if core is not None:
            self._output = None
            core.close()
            self._core = None
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- listeners ------------------------------------------------------------------
    def add_stats_listener(self, listener: StatsListener) -> None:
        self._stats_listeners.append(listener)

    def add_death_listener(self, listener: Callable[[str], None]) -> None:
        """``listener(cause)`` runs on the event loop when the engine core dies."""
        self._death_listeners.append(listener)

    def _notify(self, core: CoreStats | None, it: IterationStats | None) -> None:
        for listener in self._stats_listeners:
            listener.record(core, it)

    # --- requests -------------------------------------------------------------------
    def check_ready(self) -> None:
        """Raise the 503 error that says why requests cannot be served now, if any."""
        if self.state is EngineState.READY:
            return
        if self.state is EngineState.STARTING:
            raise EngineNotReadyError("the model is still loading; retry in a few seconds")
        raise EngineDeadError(f"the engine is not running: {self.dead_cause or 'stopped'}")

    async def run_in_pool(self, fn, *args):
        """Run blocking text work (tokenize, chat template, decode) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def generate(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       *, arrival_time: float | None = None, priority: int = 0,
                       cache_salt: str | None = None, pooling=None, lora_request=None
                       ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come (per ``params.output_kind``).
        ``pooling`` (a PoolingParams): prefill and pool the prompt instead; one output
        comes, with the vector in ``RequestOutput.pooled``.

        Raises the request's kvflow error (bad input, prompt too long, queue full, engine
        dead). Closing the iterator early aborts the request in the engine core.
        """
        self.check_ready()
        if request_id in self._streams:
            raise InvalidParameterError(f"request id {request_id!r} is already in use",
                                        param="request_id")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        processed = await self.run_in_pool(self.processor.process, request_id, prompt,
                                           params, arrival, priority, cache_salt, pooling,
                                           lora_request)
        self.check_ready()
        if request_id in self._streams:
            raise InvalidParameterError(f"request id {request_id!r} is already in use",
                                        param="request_id")
        stream = _RequestStream()
        self._streams[request_id] = stream
        self.output_processor.add_request(processed, arrival)
        self._send(AddRequest(request_id, processed.core_requests))
        done = False
        try:
            while True:
                out = None
                for item in await stream.get_all():
                    if isinstance(item, RequestOutput):
                        # A consumer that fell behind gets what piled up as one output.
                        out = item if out is None else merge_outputs(
                            out, item, processed.params.output_kind)
                        continue
                    if out is not None:  # what came before the error goes out first
                        done = out.finished
                        yield out
                        out = None
                    done = True
                    if item is _ABORTED:
                        return
                    raise item
                if out is not None:
                    done = out.finished
                    yield out
                    if done:
                        return
        finally:
            self._streams.pop(request_id, None)
            if not done:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """End a request now: its engine-core sequences stop within one step."""
        op = self.output_processor
        state = op.requests.get(request_id) if op is not None else None
        if state is not None:
            child_ids = op.abort_request(request_id)
            if child_ids and self.state is EngineState.READY:
                self._send(Abort(child_ids))
            self._notify(None, self._tracker.on_abort(state, child_ids, time.monotonic()))
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(_ABORTED)

    def end_streams(self, message: str) -> None:
        """End every request in flight with EngineDeadError(message): a shutdown whose
        grace period ran out. Each response then closes as an error (a stream with an
        error event and [DONE]) instead of being cut by the server mid-body."""
        for request_id, stream in list(self._streams.items()):
            stream.put(EngineDeadError(message))  # before abort's marker: this is raised
            self.abort(request_id)

    def call_soon_threadsafe(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the engine's event loop (e.g. from a signal handler)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn, *args)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    # --- the sockets ----------------------------------------------------------------
    def _send(self, msg) -> None:
        if self._core is None:
            return
        try:
            self._core.input.send(self._codec.encode(msg), zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:  # no peer: the core is gone
            self._die(f"cannot reach the engine core: {e}")

    async def _read_outputs(self) -> None:
        try:
            while True:
                frame = await self._output.recv(copy=False)
                msg = self._codec.decode(frame.buffer)
                try:
                    self._dispatch(msg)
                except Exception as e:  # a bug here must cost the requests involved only
                    logger.exception("error handling engine core output")
                    self._fail_outputs(msg, e)
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as e:
            if self.state is not EngineState.STOPPED:
                self._die(f"lost the engine core's output socket: {e}")
        except Exception as e:  # undecodable message: the two sides disagree
            logger.exception("bad message from the engine core")
            self._die(f"bad message from the engine core: {type(e).__name__}: {e}")

    def _fail_outputs(self, msg, exc: Exception) -> None:
        """End the requests of an output batch that could not be processed."""
        if not isinstance(msg, Outputs) or self.output_processor is None:
            return
        parents = {entry[0].request_id for o in msg.outputs
                   if (entry := self.output_processor.child_to_parent.get(o.req_id))}
        for rid in parents:
            stream = self._streams.get(rid)
            if stream is not None:  # the error first: the generator raises it
                stream.put(KvflowError(f"internal error while processing the output: "
                                             f"{type(exc).__name__}: {exc}"))
            self.abort(rid)

    def _drain_sync(self) -> None:
        """Handle what the core sent before it exited (the reader may not have run)."""
        if self._core is None:
            return
        while True:
            try:
                frame = self._core.output.recv(zmq.NOBLOCK, copy=False)
            except zmq.ZMQError:
                return
            self._dispatch(self._codec.decode(frame.buffer))

    def _dispatch(self, msg) -> None:
        if isinstance(msg, Outputs):
            self._on_outputs(msg)
        elif isinstance(msg, Stats):
            self.core_stats = msg.stats
            self._notify(msg.stats, None)
        elif isinstance(msg, RequestError):
            self._on_request_error(msg)
        elif isinstance(msg, RequestFailed):
            self._on_request_failed(msg)
        elif isinstance(msg, Ready):
            if self._ready_future is not None and not self._ready_future.done():
                self._ready_future.set_result(msg)
        elif isinstance(msg, EngineError):
            self._core_error = msg.message  # logged with the exit that follows

    def _on_outputs(self, msg: Outputs) -> None:
        self.core_stats = msg.stats
        op = self.output_processor
        if op is None:
            return
        now = time.monotonic()
        outputs = msg.outputs
        # Samples that already ended (stop string) may still send a step's tokens.
        entries = [e if e is not None and e[1].finish_reason is None else None
                   for e in (op.child_to_parent.get(o.req_id) for o in outputs)]
        request_outputs, stopped = op.process_outputs(outputs)
        if stopped:
            self._send(FinishStopped([cid for cid, _ in stopped], [s for _, s in stopped]))
        for ro in request_outputs:
            stream = self._streams.get(ro.request_id)
            if stream is not None:
                stream.put(ro)
        it = self._tracker.on_outputs(outputs, entries, now)
        it.step_s = msg.step_s
        it.api_s = time.monotonic() - now
        self._notify(msg.stats, it)

    def _on_request_failed(self, msg: RequestFailed) -> None:
        """The core ended one sample because a step failed on it: fail its request (the
        error first, so its generator raises it) and abort its other samples."""
        op = self.output_processor
        entry = op.child_to_parent.get(msg.request_id) if op is not None else None
        if entry is None:
            return
        rid = entry[0].request_id
        stream = self._streams.get(rid)
        if stream is not None:
            stream.put(errors.RequestFailedError(msg.message))
        self.abort(rid)

    def _on_request_error(self, msg: RequestError) -> None:
        op = self.output_processor
        state = op.requests.get(msg.request_id) if op is not None else None
        if state is not None:
            n = state.params.n
            self._tracker.forget([child_request_id(msg.request_id, i, n) for i in range(n)])
            op.abort_request(msg.request_id)  # the core holds none of its sequences
        stream = self._streams.get(msg.request_id)
        if stream is not None:
            stream.put(_error_from_core(msg))
