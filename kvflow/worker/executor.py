"""Runs the model runner (one rank today; the interface is what N ranks would share)."""

from __future__ import annotations

from kvflow.config import EngineConfig
from kvflow.core.sched_output import SchedulerOutput
from kvflow.worker.model_runner import ModelRunner, StepHandle


class Executor:
    """Owns the worker(s); the engine core talks only to this."""

    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner(config)

    def initialize(self) -> int:
        """Size and allocate the KV cache; returns the number of blocks."""
        num_blocks = self.runner.determine_num_blocks()
        self.runner.init_kv_cache(num_blocks)
        self.runner.warmup()
        return num_blocks

    def execute_model_async(self, so: SchedulerOutput) -> StepHandle:
        """Launch a step; ``result()`` on the handle waits for it."""
        return self.runner.execute_model_async(so)

    def shutdown(self) -> None:
        self.runner = None
