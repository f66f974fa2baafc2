"""The engine core: scheduler plus executor, one step at a time.

It runs in-process under ``LLMEngine`` (offline API) and in its own process under the
server. It sees only EngineCoreRequests and produces EngineCoreOutputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvflow.config import EngineConfig
from kvflow.core.request import Request, RequestStatus
from kvflow.core.sched_output import EngineCoreOutput, EngineCoreRequest
from kvflow.core.scheduler import Scheduler
from kvflow.logger import init_logger
from kvflow.worker.executor import Executor

logger = init_logger(__name__)


@dataclass
class SchedulerStats:
    """A snapshot for logs and metrics."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    num_blocks: int


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        self.config = config
        self.executor = Executor(config)
        self.num_blocks = self.executor.initialize()
        self.scheduler = Scheduler(config.scheduler, config.cache.block_size, self.num_blocks)
        logger.info("engine core ready in %.1f s", time.perf_counter() - start)

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request; raises a kvflow error if it can never run."""
        parent = self.scheduler.requests.get(req.fork_of) if req.fork_of else None
        self.scheduler.add_request(Request(
            req.request_id, req.prompt_token_ids, req.sampling_params,
            eos_token_ids=frozenset(req.eos_token_ids), arrival_time=req.arrival_time,
            priority=req.priority, fork_parent=parent))

    def abort_requests(self, req_ids: list[str]) -> None:
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, req_ids: list[str], stop_reason: str | None = None) -> None:
        """End requests that stopped on a stop string found after detokenization."""
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_STOPPED, stop_reason)

    def step(self) -> list[EngineCoreOutput]:
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty and not sched_out.finished_req_ids:
            return []
        runner_out = self.executor.execute_model(sched_out)
        return self.scheduler.update_from_output(sched_out, runner_out)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> SchedulerStats:
        s = self.scheduler
        return SchedulerStats(num_running=s.num_running, num_waiting=s.num_waiting,
                              kv_cache_usage=s.kv.usage, num_preemptions=s.num_preemptions,
                              num_blocks=self.num_blocks)

    def shutdown(self) -> None:
        self.executor.shutdown()
