"""The host-overhead meter behind ``kvflow bench latency --profile-host``.

Where a step's host time goes: each phase of the engine loop (scheduler, worker state
update, step building, model forward, logits, sampling metadata, sampling, output lists,
output processing) is timed by wrapping that one method on the live engine objects for
the duration of a measured run, then restoring it. Times are exclusive: a phase's time
excludes the phases nested inside it, so the rows add up to the engine loop's total.
A second, shorter run under ``torch.profiler`` lists the torch ops the steps issue (count
and self CPU time per step), which is where the model forward's time goes op by op.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

# (phase name, how to find the owner object from the engine, attribute name).
# Owners that do not exist on this engine (e.g. no compiled step) are skipped.
_PHASES: list[tuple[str, Callable, str]] = [
    ("engine loop (other)", lambda e: e, "step"),
    ("scheduler.schedule", lambda e: e.core.scheduler, "schedule"),
    ("scheduler.update_from_output", lambda e: e.core.scheduler, "update_from_output"),
    ("worker (other)", lambda e: _runner(e), "execute_model_async"),
    ("worker: update persistent batch", lambda e: _runner(e).step_builder, "update"),
    ("worker: build step inputs", lambda e: _runner(e).step_builder, "build"),
    ("worker: attention metadata", lambda e: _runner(e).step_builder.attn_builder, "build"),
    ("model forward", lambda e: _runner(e).model, "forward"),
    ("model forward (compiled step)", lambda e: _runner(e).graphs, "run"),
    ("model forward (eager, compiled engine)", lambda e: _runner(e).graphs, "run_eager"),
    ("logits (lm head)", lambda e: _runner(e).model, "compute_logits"),
    ("sampling metadata", lambda e: _runner(e).step_builder, "sampling_metadata"),
    ("sampler", lambda e: _runner(e).sampler, "forward"),
    ("worker: record sampled", lambda e: _runner(e).step_builder, "record_sampled"),
    ("worker: output lists", lambda e: _runner(e).step_builder, "finish"),
    ("output processing", lambda e: e.output_processor, "process_outputs"),
]


def _runner(engine):
    return engine.core.executor.runner


class PhaseMeter:
    """Wraps methods of live objects with exclusive timers; ``detach()`` restores them."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[float] = []  # time spent in children of each open phase
        self._undo: list[tuple[object, str, bool, object]] = []

    def attach(self, engine) -> "PhaseMeter":
        for name, owner_of, attr in _PHASES:
            try:
                owner = owner_of(engine)
            except AttributeError:
                continue
            if owner is None or not hasattr(owner, attr):
                continue
            if name == "model forward" and _runner(engine).graphs is not None:
                # The compiled layers are reached through model.forward: its steps are
                # timed through graphs.run and graphs.run_eager instead.
                continue
            self._wrap(owner, attr, name)
        return self

    def _wrap(self, owner, attr: str, name: str) -> None:
        had_own = attr in getattr(owner, "__dict__", {})
        original = getattr(owner, attr)
        stack, seconds, calls = self._stack, self.seconds, self.calls

        def timed(*args, **kwargs):
            start = time.perf_counter()
            stack.append(0.0)
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                children = stack.pop()
                seconds[name] += elapsed - children
                calls[name] += 1
                if stack:
                    stack[-1] += elapsed

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, had_own, original))

    def detach(self) -> None:
        for owner, attr, had_own, original in reversed(self._undo):
            if had_own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)
        self._undo = []

    def report(self, steps: int, num_layers: int) -> dict:
        total = sum(self.seconds.values())
        phases = {name: {"ms_per_step": s / steps * 1000, "share": s / total if total else 0.0,
                         "calls": self.calls[name]}
                  for name, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])}
        fwd = sum(s for n, s in self.seconds.items() if n.startswith("model forward"))
        return {"steps": steps, "host_ms_per_step": total / steps * 1000,
                "forward_ms_per_step": fwd / steps * 1000,
                "forward_us_per_layer": fwd / steps / num_layers * 1e6, "phases": phases}


def profile_ops(run: Callable[[], int], top: int = 20) -> dict:
    """Torch ops issued by ``run()`` (which returns its number of steps): per-step counts
    and self CPU time, the most expensive first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        steps = run()
    rows = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    total_count = sum(e.count for e in rows if e.key.startswith("aten::"))
    rows.sort(key=lambda e: -e.self_cpu_time_total)
    return {"steps": steps,
            "aten_ops_per_step": total_count / steps,
            "top_ops": [{"op": e.key, "calls_per_step": e.count / steps,
                         "self_us_per_step": e.self_cpu_time_total / steps}
                        for e in rows[:top]]}


def print_report(tag: str, report: dict) -> None:
    print(f"[{tag}] host time {report['host_ms_per_step']:.3f} ms/step, model forward "
          f"{report['forward_ms_per_step']:.3f} ms/step = "
          f"{report['forward_us_per_layer']:.1f} us/layer")
    for name, p in report["phases"].items():
        print(f"[{tag}]   {name:34s} {p['ms_per_step']:8.3f} ms/step {100 * p['share']:5.1f}%")
    ops = report.get("ops")
    if ops:
        print(f"[{tag}] torch ops: {ops['aten_ops_per_step']:.0f} aten calls per step; top:")
        for o in ops["top_ops"][:10]:
            print(f"[{tag}]   {o['op']:40s} {o['calls_per_step']:7.1f}/step "
                  f"{o['self_us_per_step']:9.1f} us/step")
