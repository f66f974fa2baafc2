"""Runs the model on one rank or many; the engine core talks only to this.

With several ranks (tensor and/or pipeline parallel) this process is rank 0, beside the
scheduler; the other ranks of this node are spawned as ``kvflow.worker.rank_proc``
processes (remote nodes start theirs with ``kvflow serve --node-rank R``). Every step,
rank 0 broadcasts the SchedulerOutput as a typed message over the gloo control group,
then all ranks run the step together; rank 0 alone samples and returns the outputs. A
rank that dies makes the next collective fail (gloo notices the closed connection, or
the collective times out), and that failure ends the engine with a DistributedError
naming the rank.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import weakref

import torch

from kvflow.config import EngineConfig
from kvflow.core.sched_output import SchedulerOutput
from kvflow.cpu.threads import set_rank_threads
from kvflow.errors import DistributedError, InvalidParameterError, KvflowError
from kvflow.logger import init_logger
from kvflow.worker.model_runner import ModelRunner, StepHandle

logger = init_logger(__name__)

# After a collective failed, how long to wait for the dead rank's exit to be visible so
# the error can name it.
DEATH_NOTICE_S = 2.0


def rank_config(config: EngineConfig, rank: int, local_rank: int) -> EngineConfig:
    """The config one rank runs with: a GPU rank uses the GPU of its local rank, and
    knows its pipeline stage."""
    dev = config.device.device
    if dev.startswith("cuda") and config.parallel.world_size > 1:
        base = int(dev.split(":")[1]) if ":" in dev else 0
        dev = f"cuda:{base + local_rank}"
    stage = rank // config.parallel.tensor_parallel_size
    return dataclasses.replace(config, device=dataclasses.replace(config.device, device=dev),
                               parallel=dataclasses.replace(config.parallel, stage=stage))


def _check_torchrun_rank0() -> None:
    from kvflow.distributed.torchrun import torchrun_rank

    tr = torchrun_rank()
    if tr is not None and tr.rank != 0:
        raise InvalidParameterError(
            f"under torchrun only RANK 0 runs the engine; this is RANK {tr.rank}: start "
            f"every rank with the kvflow command (kvflow serve or kvflow generate), which "
            f"runs the other ranks' loop", param="RANK")


def _kill_now(procs) -> None:
    for p in procs:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait()


class Executor:
    """Owns the worker(s)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.procs = []
        self.state = None
        self.failed: str | None = None
        # Pipeline batches in flight: step messages posted to the ranks, not yet taken by
        # all of them (the oldest are waited for once more than that many are out).
        self._posted: collections.deque[list] = collections.deque()
        pc = config.parallel
        if pc.world_size == 1:
            self.runner = ModelRunner(config)
            return
        if pc.node_rank != 0:
            raise InvalidParameterError("the engine (scheduler and rank 0) runs on node 0; "
                                        "other nodes run their ranks only", param="node_rank")
        from kvflow.distributed import init_parallel_state
        from kvflow.distributed.launch import spawn_ranks
        from kvflow.distributed.rendezvous import listen_socket

        set_rank_threads(config)
        listen = None
        if pc.launcher == "torchrun":
            _check_torchrun_rank0()
            port = pc.master_port  # torchrun started the other ranks already
        else:
            # The store's socket first, so the ranks get a port that is already taken.
            listen = listen_socket(pc)
            port = listen.getsockname()[1]
            self.procs = spawn_ranks(config, [(r, r) for r in range(1, pc.ranks_per_node)],
                                     port)
        self._finalizer = weakref.finalize(self, _kill_now, self.procs)
        cfg = rank_config(config, 0, 0)
        try:
            self.state = init_parallel_state(pc, 0, 0, port, torch.device(cfg.device.device),
                                             listen)
            from kvflow.distributed.messages import Setup, broadcast_message

            broadcast_message(self.state.control, Setup(config))
            self.runner = ModelRunner(cfg, self.state)
        except Exception as e:
            try:
                self._fail(e)
            except DistributedError:
                if isinstance(e, KvflowError) and not isinstance(e, DistributedError):
                    # Rank 0 refused the model itself (e.g. a split the quantized
                    # weights do not allow): that, not the ranks it stopped, is the news.
                    raise e from None
                raise
            finally:
                self.shutdown()

    def initialize(self) -> int:
        """Size and allocate the KV cache; returns the number of blocks."""
        if self.state is None:
            return self.runner.initialize()
        try:
            return self.runner.initialize()
        except Exception as e:
            try:
                self._fail(e)
            finally:
                self.shutdown()

    def execute_model_async(self, so: SchedulerOutput) -> StepHandle:
        """Launch a step on every rank; ``result()`` on the handle waits for it."""
        if self.state is None:
            return self.runner.execute_model_async(so)
        from kvflow.distributed.launch import first_failure
        from kvflow.distributed.messages import (ExecuteStep, broadcast_message,
                                                 broadcast_message_async)

        if self.failed is not None:
            raise DistributedError(self.failed)
        why = first_failure(self.procs)
        if why is not None:
            self._fail(None, why)
        try:
            depth = self.config.parallel.batches_in_flight
            if depth > 1:
                # A later stage takes this message when it is done with the batches
                # before it; rank 0 goes on with its own stage of this one meanwhile.
                self._posted.append(broadcast_message_async(self.state.control,
                                                            ExecuteStep(so)))
                while len(self._posted) > depth:
                    for work in self._posted.popleft():
                        work.wait()
            else:
                broadcast_message(self.state.control, ExecuteStep(so))
            return self.runner.execute_model_async(so)
        except Exception as e:
            self._fail(e)

    def _fail(self, error: Exception | None, why: str | None = None):
        """Raise a DistributedError that names the rank that ended, if one did."""
        from kvflow.distributed.launch import first_failure

        if isinstance(error, DistributedError):
            self.failed = error.message
            raise error
        if why is None and self.procs:
            deadline = time.monotonic() + DEATH_NOTICE_S
            while why is None and time.monotonic() < deadline:
                why = first_failure(self.procs)
                if why is None:
                    time.sleep(0.05)
        cause = f"{type(error).__name__}: {error}" if error is not None else ""
        if why is None:
            why = "a collective between the ranks failed" + (f" ({cause})" if cause else "")
        self.failed = f"distributed engine stopped: {why}"
        _kill_now(self.procs)  # the engine cannot go on without a rank: stop the rest
        logger.error("%s%s", self.failed, f" ({cause})" if cause and cause not in why else "")
        raise DistributedError(self.failed) from None

    def shutdown(self) -> None:
        """Stop every rank: a clean stop message when all are alive, else kill them."""
        if self.state is not None:
            from kvflow.distributed import destroy_parallel_state
            from kvflow.distributed.launch import first_failure, stop_ranks
            from kvflow.distributed.messages import StopWorkers, broadcast_message

            clean = self.failed is None and first_failure(self.procs) is None
            if clean:
                try:
                    while self._posted:
                        for work in self._posted.popleft():
                            work.wait()
                    broadcast_message(self.state.control, StopWorkers())
                except Exception:
                    clean = False
            if not clean:
                _kill_now(self.procs)
            stop_ranks(self.procs)
            destroy_parallel_state(self.state)
            self.state = None
        elif self.procs:
            _kill_now(self.procs)
        self.runner = None
