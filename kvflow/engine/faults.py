"""A test-only fault injector: makes the worker fail on one request's data.

With ``KVFLOW_FAULT_TOKEN=T`` set, the EngineCore wraps its executor so that a step that
schedules a request whose tokens contain ``T`` raises after the worker has taken the step
in (its batch updated, the step launched), the way a bug that one request's values
trigger deep in the worker would. Tests use it, in-process and through the server, to
show that such a request ends with an error while the others finish.
"""

from __future__ import annotations

from kvflow.core.sched_output import SchedulerOutput


class InjectedFault(RuntimeError):
    """The failure the injector raises."""


class FaultInjectingExecutor:
    """Wraps an Executor; everything but ``execute_model_async`` passes through."""

    def __init__(self, executor, token: int) -> None:
        self._executor = executor
        self.token = token
        self.poisoned: set[str] = set()  # requests whose tokens contain the token

    def __getattr__(self, name: str):
        return getattr(self._executor, name)

    def execute_model_async(self, so: SchedulerOutput):
        self.poisoned.difference_update(so.finished_req_ids)
        for new in so.new_reqs:
            if self.token in new.token_ids:
                self.poisoned.add(new.req_id)
        handle = self._executor.execute_model_async(so)
        bad = sorted(self.poisoned & set(so.num_scheduled_tokens))
        if bad:
            raise InjectedFault(f"injected fault: token {self.token} in {bad[0]}")
        return handle
