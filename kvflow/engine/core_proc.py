"""The engine-core process: the scheduler and the model in a busy loop, fed over ZMQ.

The API process (``AsyncEngine``) starts it as a plain subprocess::

    python -m kvflow.engine.core_proc --input ipc://DIR/input --output ipc://DIR/output \\
        --engine-args '{"model": "smollm2-135m", ...}'

so nothing is pickled, not even at start-up. It connects to the two sockets the API
process bound in its private directory, builds the EngineCore, sends ``Ready``, then
loops: drain every waiting message (blocking only while it has nothing to run), run one
engine step, send the step's outputs with the scheduler's stats. A request the core
refuses gets a ``RequestError``; any other failure sends ``EngineError`` with the cause
and exits non-zero. It also exits when the API process is gone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
import traceback

import zmq

from kvflow import envs
from kvflow.engine.args import EngineArgs
from kvflow.engine.messages import (Abort, AddRequest, CoreStats, EngineError, FinishStopped,
                                    Outputs, Ready, RequestError, RequestFailed, Shutdown,
                                    Stats, core_codec)
from kvflow.errors import KvflowError
from kvflow.logger import init_logger

logger = init_logger("kvflow.engine.core_proc")  # __name__ is __main__ under -m

# How long an idle loop waits for a message before checking that its parent still lives.
IDLE_POLL_MS = 500
# How long to wait when runnable requests exist but none could be scheduled this step.
STALL_POLL_MS = 1
# How long buffered messages (the last outputs, an EngineError) may take to leave at exit.
LINGER_MS = 2000


class EngineCoreProc:
    """The loop around one EngineCore, talking to the API process through two sockets."""

    def __init__(self, config, input_sock: zmq.Socket, output_sock: zmq.Socket,
                 parent_pid: int) -> None:
        from kvflow.engine.core import EngineCore

        start = time.perf_counter()
        self.config = config
        self.input = input_sock
        self.output = output_sock
        self.parent_pid = parent_pid
        self.codec = core_codec()
        self.core = EngineCore(config)
        self._last_stats: CoreStats | None = None
        m, c = config.model, config.cache
        kv_bytes = self.core.num_blocks * c.block_size * m.arch.kv_bytes_per_token(m.dtype)
        self._send(Ready(num_blocks=self.core.num_blocks, block_size=c.block_size,
                         max_model_len=m.max_model_len, kv_cache_bytes=kv_bytes,
                         device=config.device.device, dtype=m.dtype,
                         startup_s=time.perf_counter() - start, pid=os.getpid(),
                         determinism=self.core.determinism.mode,
                         determinism_why=self.core.determinism.why,
                         fingerprint=self.core.determinism.fingerprint))

    def _send(self, msg) -> None:
        self.output.send(self.codec.encode(msg), copy=False)

    def stats(self) -> CoreStats:
        return self.core.stats()

    def run(self) -> bool:
        """Serve until a Shutdown message arrives (returns True) or the parent process is
        gone (returns False)."""
        poller = zmq.Poller()
        poller.register(self.input, zmq.POLLIN)
        stalled = False
        while True:
            if os.getppid() != self.parent_pid:
                logger.warning("the API process is gone; engine core exiting")
                return False
            if not self.core.has_unfinished_requests():
                self._send_stats_if_changed()
                if not poller.poll(IDLE_POLL_MS):
                    continue
            elif stalled:
                poller.poll(STALL_POLL_MS)
            if not self._drain():
                return True
            stalled = False
            if self.core.has_unfinished_requests():
                steps = self.core.num_steps
                start = time.perf_counter()
                outputs = self.core.step()
                elapsed = time.perf_counter() - start
                stalled = self.core.num_steps == steps and not outputs
                for failure in self.core.take_failures():
                    self._send(RequestFailed(failure.request_id, failure.message))
                if outputs:
                    stats = self.stats()
                    self._send(Outputs(outputs=outputs, stats=stats, step_s=elapsed))
                    self._last_stats = stats
            self._send_stats_if_changed()

    def _send_stats_if_changed(self) -> None:
        stats = self.stats()
        if stats != self._last_stats:
            self._send(Stats(stats=stats))
            self._last_stats = stats

    def _drain(self) -> bool:
        """Handle every message already waiting; False once Shutdown arrived."""
        while True:
            try:
                data = self.input.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            msg = self.codec.decode(data.buffer)
            if isinstance(msg, Shutdown):
                return False
            self._handle(msg)

    def _handle(self, msg) -> None:
        if isinstance(msg, AddRequest):
            try:
                self.core.add_requests(msg.requests)
            except KvflowError as e:
                self._send(RequestError(msg.request_id, type(e).__name__, e.message,
                                        e.param))
            except Exception as e:  # a bug, but one request must not take the core down
                logger.exception("engine core could not add request %s", msg.request_id)
                self._send(RequestError(msg.request_id, "KvflowError",
                                        f"internal error: {type(e).__name__}: {e}"))
        elif isinstance(msg, Abort):
            self.core.abort_requests(msg.request_ids)
        elif isinstance(msg, FinishStopped):
            for rid, stop in zip(msg.request_ids, msg.stop_reasons):
                self.core.finish_requests([rid], stop_reason=stop)
        else:
            raise TypeError(f"unexpected message {type(msg).__name__}")


def _set_cpu_threads(config) -> None:
    if config.device.device != "cpu":
        return
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    # On a large machine one core stays with the API process (HTTP, detokenization), at a
    # cost of 1/8 of the cores or less. On a small one that core is worth more to the
    # engine: on 2 cores, 2 threads against 1 gave 32 vs 51 ms per token for one stream
    # and 282 vs 167 tokens/s for 64 streams, the API process keeping up in both.
    threads = envs.cpu_threads() or (cores - 1 if cores >= 8 else cores)
    torch.set_num_threads(threads)
    logger.info("engine core on CPU: %d torch thread(s) of %d core(s)", threads, cores)


def _remove_ipc_dir(address: str) -> None:
    if address.startswith("ipc://"):
        shutil.rmtree(os.path.dirname(address[len("ipc://"):]), ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description="kvflow engine-core process (started by "
        "the API server, not by hand)")
    parser.add_argument("--input", required=True, help="ZMQ address to read requests from")
    parser.add_argument("--output", required=True, help="ZMQ address to send outputs to")
    parser.add_argument("--engine-args", required=True, help="EngineArgs as a JSON object")
    ns = parser.parse_args(argv)
    # Ctrl-C in a terminal reaches the whole process group: the API process decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    ctx = zmq.Context()
    input_sock = ctx.socket(zmq.PULL)
    output_sock = ctx.socket(zmq.PUSH)
    output_sock.setsockopt(zmq.SNDHWM, 0)
    input_sock.setsockopt(zmq.RCVHWM, 0)
    input_sock.connect(ns.input)
    output_sock.connect(ns.output)
    codec = core_codec()
    proc = None
    try:
        config = EngineArgs(**json.loads(ns.engine_args)).create_engine_config()
        _set_cpu_threads(config)
        proc = EngineCoreProc(config, input_sock, output_sock, parent)
        if not proc.run():
            _remove_ipc_dir(ns.input)  # the API process could not clean up after itself
        return 0
    except Exception as e:
        cause = f"{type(e).__name__}: {e}"
        if not isinstance(e, KvflowError):
            logger.error("engine core failed:\n%s", traceback.format_exc())
        output_sock.send(codec.encode(EngineError(cause)))
        return 1
    finally:
        if proc is not None:
            proc.core.shutdown()
        input_sock.close(linger=0)
        output_sock.close(linger=LINGER_MS)
        ctx.term()


if __name__ == "__main__":
    sys.exit(main())
