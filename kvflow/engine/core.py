"""The engine core: scheduler plus executor, one step at a time.

It runs in-process under ``LLMEngine`` (offline API) and in its own process under the
server. It sees only EngineCoreRequests and produces EngineCoreOutputs.
"""

from __future__ import annotations

import time

from kvflow.config import EngineConfig
from kvflow.core.request import Request, RequestStatus
from kvflow.core.sched_output import EngineCoreOutput, EngineCoreRequest
from kvflow.core.scheduler import Scheduler, SwapPolicy
from kvflow.engine.messages import CoreStats
from kvflow.errors import InvalidParameterError, QueueFullError
from kvflow.logger import init_logger
from kvflow.worker.executor import Executor

logger = init_logger(__name__)


def swap_policy(config: EngineConfig) -> SwapPolicy | None:
    """Preemption policy with rough costs for ``auto``: recomputing a token costs its
    matmul FLOPs at a sustained rate; swapping a block costs its bytes over the host link
    (each way)."""
    from kvflow.worker.kv_cache import block_bytes, num_host_blocks

    host = num_host_blocks(config)
    if not host:
        return None
    gpu = config.device.is_cuda
    flops_per_s = 400e12 if gpu else 1e11  # sustained prefill rate: H100/H200-class, CPU
    link_bytes_per_s = 20e9 if gpu else 10e9  # pinned PCIe copies / host memcpy
    return SwapPolicy(config.cache.preemption_mode, host,
                      recompute_s_per_token=2 * config.model.arch.num_params / flops_per_s,
                      swap_s_per_block=block_bytes(config) / link_bytes_per_s)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        self.config = config
        self.executor = Executor(config)
        self.num_blocks = self.executor.initialize()
        self.scheduler = Scheduler(config.scheduler, config.cache.block_size, self.num_blocks,
                                   config.cache.enable_prefix_caching, swap_policy(config))
        self.num_steps = 0
        self._in_flight = None  # (SchedulerOutput, StepHandle) launched, not yet collected
        logger.info("engine core ready in %.1f s", time.perf_counter() - start)

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request; raises a kvflow error if it can never run."""
        sp = req.sampling_params
        if self.config.parallel.pipeline_parallel_size > 1 and (
                sp.logprobs is not None or sp.prompt_logprobs is not None):
            # The last stage samples; its logprobs do not travel back to rank 0 yet.
            raise InvalidParameterError("logprobs and prompt_logprobs are not supported "
                                        "with pipeline parallelism yet",
                                        param="logprobs" if sp.logprobs is not None
                                        else "prompt_logprobs")
        parent = self.scheduler.requests.get(req.fork_of) if req.fork_of else None
        self.scheduler.add_request(Request(
            req.request_id, req.prompt_token_ids, req.sampling_params,
            eos_token_ids=frozenset(req.eos_token_ids), arrival_time=req.arrival_time,
            priority=req.priority, fork_parent=parent, cache_salt=req.cache_salt))

    def add_requests(self, reqs: list[EngineCoreRequest]) -> None:
        """Queue the samples of one request, all or none.

        Raises QueueFullError when ``max_queued_requests`` are already waiting (server
        back-pressure; an empty queue always takes the request), or the error of a sample
        that can never run.
        """
        limit = self.config.scheduler.max_queued_requests
        waiting = self.scheduler.num_waiting
        if limit is not None and waiting and waiting + len(reqs) > limit:
            raise QueueFullError(f"the server is busy: {waiting} requests are waiting "
                                 f"(limit {limit}); retry later")
        added: list[str] = []
        try:
            for req in reqs:
                self.add_request(req)
                added.append(req.request_id)
        except Exception:
            self.abort_requests(added)
            raise

    def abort_requests(self, req_ids: list[str]) -> None:
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, req_ids: list[str], stop_reason: str | None = None) -> None:
        """End requests that stopped on a stop string found after detokenization."""
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_STOPPED, stop_reason)

    def step(self) -> list[EngineCoreOutput]:
        """Run one step; returns the outputs of the step that completed.

        With async scheduling, this schedules and launches step N+1 before it waits for
        step N, so the GPU always has the next step queued while the CPU updates state:
        the outputs returned are step N's.
        """
        sched_out = self.scheduler.schedule()
        handle = None
        if not sched_out.is_empty or sched_out.finished_req_ids:
            handle = self.executor.execute_model_async(sched_out)
            if not sched_out.is_empty:
                self.num_steps += 1
        if not self.config.scheduler.async_scheduling:
            if handle is None:
                return []
            return self.scheduler.update_from_output(sched_out, handle.result())
        outputs: list[EngineCoreOutput] = []
        if self._in_flight is not None:
            prev_out, prev_handle = self._in_flight
            outputs = self.scheduler.update_from_output(prev_out, prev_handle.result())
        self._in_flight = (sched_out, handle) if handle is not None else None
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def stats(self) -> CoreStats:
        """A snapshot of the scheduler for logs and /metrics (sent as is over IPC)."""
        s = self.scheduler
        return CoreStats(num_running=s.num_running, num_waiting=s.num_waiting,
                         num_blocks=self.num_blocks,
                         num_used_blocks=self.num_blocks - s.kv.num_free_blocks,
                         kv_cache_usage=s.kv.usage, num_preemptions=s.num_preemptions,
                         num_steps=self.num_steps)

    def shutdown(self) -> None:
        self.executor.shutdown()
