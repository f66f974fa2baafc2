"""How many torch threads a CPU step runs on: each rank of a parallel engine its share
of the node's cores (``set_rank_threads``); a one-rank engine's steps a count chosen by
measuring (``StepThreadPolicy``).

A decode step of a small batch is thousands of tiny ops. With two or more intra-op
threads each op that goes parallel ends in a barrier, and on a shared machine the other
thread is often descheduled: measured on the 2-core development machine at load ~9, the
30-layer hidden-64 model's decode forward took 151 ms on two threads and 8.4 ms on one.
On a quiet machine the answer depends on the model: the same tiny model is no faster on
two threads, while the dense 135M model decodes one stream faster on two (32 vs 51 ms per
token). Prompt-heavy steps too: at load 4-7 a step of 10 decodes and 64 prompt tokens
of the embedded model took 3.4-4.4 s on two threads and 1.0 s on one (and 16 prompt
tokens 2.0 vs 0.31 s), while on a quiet machine their GEMMs split well. No fixed rule
fits, so the policy measures: per size class of step (scheduled tokens in powers of two),
it times steps on one thread and on all of them and runs the faster, trying the slower
one again now and then (the load changes), the more rarely the longer it takes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvflow.config import EngineConfig

# Steps of more scheduled tokens than this share the top size class.
TOP_CLASS_TOKENS = 4096
# Measured steps per thread count before the policy trusts its estimate.
WARMUP_STEPS = 3
# How often (seconds) the slower thread count of a size class is tried again at most,
# and at least this many of its own step times apart (a retry of a multi-second prompt
# step then costs under 1/RETRY_COST of the time).
RETRY_SECONDS = 5.0
RETRY_COST = 50.0
# Size classes up to this one (16 tokens) take WARMUP_STEPS of each count while the two
# are close; larger steps take one each (a slow sample of a big step is costly: on the
# quiet machine three of them per class cost CPU-B 6-12% of its throughput).
SMALL_CLASSES = 4
# A thread count this many times slower than the other after one step needs no more
# warm-up steps (on a loaded machine a two-thread step can cost 200x a one-thread step).
CLEAR_FACTOR = 2.0
# Weight of the newest measurement in a thread count's running estimate.
ALPHA = 0.3


def set_rank_threads(config: EngineConfig) -> None:
    """On CPU the ranks of a node share its cores; oversubscribing them is far slower.
    (Ranks keep this count: the measuring policy below runs one-rank engines only.)"""
    if config.device.device != "cpu":
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // config.parallel.ranks_per_node))


def step_thread_policy(config: EngineConfig, world_size: int) -> StepThreadPolicy | None:
    """The policy a CPU engine's steps run under (``--cpu-step-threads adaptive``, its
    thread count read at the first step), or None: on a GPU, with all threads, or with
    several ranks (they keep the share ``set_rank_threads`` gave them)."""
    if torch.device(config.device.device).type != "cpu" or world_size != 1 or \
            config.device.cpu_step_threads != "adaptive":
        return None
    return StepThreadPolicy(None)


class _SizeClass:
    """Running step-time estimates (seconds) of one size class, per thread count."""

    def __init__(self, candidates: tuple[int, ...]) -> None:
        self.estimate: dict[int, float] = {}
        self.samples: dict[int, int] = dict.fromkeys(candidates, 0)
        self.last_tried: dict[int, float] = dict.fromkeys(candidates, 0.0)


class StepThreadPolicy:
    """``choose(num_tokens)`` picks a step's thread count, ``record`` learns from its
    time; ``run(num_tokens, fn)`` does both around ``fn`` and restores the count."""

    def __init__(self, max_threads: int | None,
                 clock: Callable[[], float] = time.perf_counter,
                 set_threads: Callable[[int], None] = torch.set_num_threads) -> None:
        """``max_threads``: the count outside the policy's steps; None: torch's count at
        the first ``run`` (the engine's setting by then)."""
        self.clock = clock
        self.set_threads = set_threads
        self.classes: dict[int, _SizeClass] = {}
        self.max_threads: int | None = None
        self.candidates: tuple[int, ...] = ()
        if max_threads is not None:
            self._set_max(max_threads)

    def _set_max(self, max_threads: int) -> None:
        self.max_threads = max_threads
        self.candidates = (1, max_threads) if max_threads > 1 else (1,)

    @staticmethod
    def size_class(num_tokens: int) -> int:
        """1, 2, 3-4, 5-8, 9-16, ... tokens -> 0, 1, 2, 3, 4, ...; steps above
        TOP_CLASS_TOKENS share the class of TOP_CLASS_TOKENS."""
        return (min(max(num_tokens, 1), TOP_CLASS_TOKENS) - 1).bit_length()

    def choose(self, num_tokens: int) -> int:
        key = self.size_class(num_tokens)
        if len(self.candidates) == 1:
            return self.max_threads
        cls = self.classes.get(key)
        if cls is None:
            cls = self.classes[key] = _SizeClass(self.candidates)
        for n in self.candidates:  # warm-up: every thread count once ...
            if cls.samples[n] == 0:
                return n
        best = min(self.candidates, key=cls.estimate.__getitem__)
        worst = max(self.candidates, key=cls.estimate.__getitem__)
        if cls.estimate[worst] < CLEAR_FACTOR * cls.estimate[best] \
                and key <= SMALL_CLASSES:
            for n in self.candidates:  # ... and a few times while they are close
                if cls.samples[n] < WARMUP_STEPS:
                    return n
        now = self.clock()
        for n in self.candidates:
            wait = max(RETRY_SECONDS, RETRY_COST * cls.estimate[n])
            if n != best and now - cls.last_tried[n] >= wait:
                return n  # has the load changed? try the slower one once
        return best

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        key = self.size_class(num_tokens)
        if key not in self.classes:
            return
        cls = self.classes[key]
        old = cls.estimate.get(threads)
        cls.estimate[threads] = seconds if old is None else old + ALPHA * (seconds - old)
        cls.samples[threads] += 1
        cls.last_tried[threads] = self.clock()

    def run(self, num_tokens: int, fn: Callable[[], object]):
        if self.max_threads is None:
            self._set_max(torch.get_num_threads())
        threads = self.choose(num_tokens)
        if len(self.candidates) == 1:
            return fn()
        if threads != self.max_threads:
            self.set_threads(threads)
        start = self.clock()
        try:
            return fn()
        finally:
            self.record(num_tokens, threads, self.clock() - start)
            if threads != self.max_threads:
                self.set_threads(self.max_threads)

    def describe(self) -> dict[str, dict[int, float]]:
        """Per size class, the estimated ms per step of each thread count (for the meter)."""
        def name(k: int) -> str:
            lo, hi = (1 << (k - 1)) + 1 if k else 1, 1 << k
            return f"{lo}" if lo == hi else f"{lo}-{hi}"
        return {f"{name(k)} tokens": {n: round(t * 1e3, 3) for n, t in c.estimate.items()}
                for k, c in sorted(self.classes.items())}
