"""The smooth-steps default of ``kvflow serve`` on CPU (``--target-step-ms``).

On two cores a prompt token costs about as much as a decode row (1.5-5 ms for the
embedded model, with the load), so the engine's 2048-token CPU budget makes prefill steps
of seconds during which every running stream stops. A server on CPU therefore sizes each
step's budget by time instead: the scheduler's step-time model (core/latency.py, learned
from the engine's own steps) keeps a step near ``CPU_SERVER_STEP_MS``, prompt chunks
shrink to fit beside the running decodes, and at least ``MIN_PROMPT_CHUNK`` prompt tokens
advance every step, so a slow or loaded machine slows prefill down but never stops it.

Why 100 ms: ten tokens a second is faster than anyone reads and what users call smooth
streaming. The seed's 50 ms bar is out of reach on two cores once a dozen streams run:
a decode step of 16 sequences alone takes 50-90 ms there, before any prompt token.
Offline use (LLM, kvflow generate, bench throughput) keeps the full budget: there, only
total throughput counts. Measured on the 2-core machine with the thread policy covering
every step size (benchmarks/results/cpu-burst-smooth-threads.json, issue 29's burst, two
alternated rounds): mean TTFT 11.8/12.5 -> 8.0/6.3 s, p99 TPOT 648/633 -> 305/245 ms,
p99 gap between tokens 12.2/10.5 s -> 0.41/0.34 s, output 23.1/22.9 -> 26.4/31.4
tokens/s; the median TPOT rises (121/99 -> 268/216 ms) as every step carries a prompt
chunk while prompts wait.
"""

from __future__ import annotations

import dataclasses

from kvflow.engine.args import EngineArgs

CPU_SERVER_STEP_MS = 100.0


def smooth_on_cpu(engine_args: EngineArgs) -> EngineArgs:
    """``engine_args`` with the CPU server's step target, unless the operator chose one
    (``--target-step-ms``, 0 for off) or a TPOT target (which bounds steps itself)."""
    if engine_args.target_step_ms is not None or engine_args.target_tpot_ms:
        return engine_args
    if engine_args._resolve_device() != "cpu":
        return engine_args
    return dataclasses.replace(engine_args, target_step_ms=CPU_SERVER_STEP_MS)
