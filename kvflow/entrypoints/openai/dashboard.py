"""The live dashboard: ``GET /dashboard`` (a page shipped in the package, no files from
the internet) and ``GET /dashboard/data`` (the JSON it polls once a second).

``DashboardStats`` is one more stats listener of the AsyncEngine: it keeps the latest
scheduler snapshot (queues, KV block map, preemptions) and per-second buckets of the last
few minutes (tokens, TTFT and TPOT samples, prefix-cache lookups), from which the page
draws its charts and distributions.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse

from kvflow.engine.messages import STRUCTURED_FIELDS, CoreStats
from kvflow.engine.stats import IterationStats

# How far back the charts and distributions reach.
WINDOW_S = 300
# Most TTFT/TPOT samples one second keeps (a burst of thousands would only repeat itself).
MAX_SAMPLES_PER_S = 256
STATIC = os.path.join(os.path.dirname(__file__), "static")
# Histogram bin edges in ms: log-spaced, 1 ms .. ~100 s.
BIN_EDGES_MS = [round(10 ** (i / 4), 3) for i in range(0, 21)]


@dataclass
class _Second:
    t: int
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    queries: int = 0
    hits: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _histogram(values: list[float]) -> list[int]:
    counts = [0] * (len(BIN_EDGES_MS) + 1)
    for x in values:
        i = 0
        while i < len(BIN_EDGES_MS) and x >= BIN_EDGES_MS[i]:
            i += 1
        counts[i] += 1
    return counts


class DashboardStats:
    """Stats listener that keeps what the dashboard shows."""

    def __init__(self, model_name: str, clock=time.monotonic) -> None:
        self.model_name = model_name
        self.clock = clock
        self.started = clock()
        self.core: CoreStats | None = None
        self.seconds: deque[_Second] = deque()
        self.total_queries = self.total_hits = 0
        self.total_generation_tokens = 0
        self.total_finished = 0

    def _bucket(self) -> _Second:
        t = int(self.clock())
        if not self.seconds or self.seconds[-1].t != t:
            c = self.core  # queues hold their last known length until the next snapshot
            self.seconds.append(_Second(t, running=c.num_running, waiting=c.num_waiting,
                                        kv_usage=c.kv_cache_usage) if c else _Second(t))
            while self.seconds and self.seconds[0].t <= t - WINDOW_S:
                self.seconds.popleft()
        return self.seconds[-1]

    def record(self, core: CoreStats | None, iteration: IterationStats | None) -> None:
        b = self._bucket()
        if core is not None:
            self.core = core
            b.running, b.waiting, b.kv_usage = (core.num_running, core.num_waiting,
                                                core.kv_cache_usage)
        if iteration is None:
            return
        b.prompt_tokens += iteration.num_prompt_tokens
        b.generation_tokens += iteration.num_generation_tokens
        b.queries += iteration.prefix_cache_queries
        b.hits += iteration.prefix_cache_hits
        self.total_queries += iteration.prefix_cache_queries
        self.total_hits += iteration.prefix_cache_hits
        self.total_generation_tokens += iteration.num_generation_tokens
        for x in iteration.ttfts_s:
            if len(b.ttft_ms) < MAX_SAMPLES_PER_S:
                b.ttft_ms.append(x * 1e3)
        for f in iteration.finished:
            b.finished += 1
            self.total_finished += 1
            if f.tpot_s is not None and len(b.tpot_ms) < MAX_SAMPLES_PER_S:
                b.tpot_ms.append(f.tpot_s * 1e3)

    def snapshot(self, extra: dict | None = None) -> dict:
        """Everything the page draws, as plain JSON."""
        now = self.clock()
        t_now = int(now)
        by_t = {b.t: b for b in self.seconds if b.t > t_now - WINDOW_S}
        series = []
        last = None
        for t in range(t_now - WINDOW_S + 1, t_now + 1):
            b = by_t.get(t)
            if b is not None:
                last = b
            series.append({
                "t": t - t_now, "tokens": b.generation_tokens if b else 0,
                "running": (b or last).running if (b or last) else 0,
                "waiting": (b or last).waiting if (b or last) else 0,
                "kv_usage": (b or last).kv_usage if (b or last) else 0.0})
        recent = [b for b in by_t.values() if b.t > t_now - 10]
        ttft = [x for b in by_t.values() for x in b.ttft_ms]
        tpot = [x for b in by_t.values() for x in b.tpot_ms]
        queries = sum(b.queries for b in by_t.values())
        hits = sum(b.hits for b in by_t.values())
        c = self.core
        kv = None
        if c is not None:
            kv = {"num_blocks": c.num_blocks, "used": c.num_used_blocks,
                  "cached": c.num_cached_blocks, "shared": c.num_shared_blocks,
                  "free": c.num_blocks - c.num_used_blocks - c.num_cached_blocks,
                  "usage": c.kv_cache_usage, "map": c.block_map}
        return {
            "model": self.model_name, "uptime_s": now - self.started,
            "queues": {"running": c.num_running if c else 0,
                       "waiting": c.num_waiting if c else 0,
                       # Preempted requests wait again at the front of the queue.
                       "preemptions": c.num_preemptions if c else 0},
            "steps": c.num_steps if c else 0,
            # Constrained decoding counters (None until a constrained request came).
            "structured": dict(zip((f[0] for f in STRUCTURED_FIELDS), c.structured))
            if c is not None and c.structured else None,
            "kv": kv,
            "tokens_per_s": sum(b.generation_tokens for b in recent) / 10.0,
            "totals": {"generation_tokens": self.total_generation_tokens,
                       "finished": self.total_finished},
            "prefix_cache": {"hit_rate_window": hits / queries if queries else None,
                             "hit_rate_total": self.total_hits / self.total_queries
                             if self.total_queries else None},
            "latency_ms": {
                name: {"count": len(v), "p50": _percentile(v, 0.5),
                       "p90": _percentile(v, 0.9), "p99": _percentile(v, 0.99),
                       "histogram": _histogram(v)}
                for name, v in (("ttft", ttft), ("tpot", tpot))},
            "bin_edges_ms": BIN_EDGES_MS,
            "window_s": WINDOW_S,
            "series": series,
            **(extra or {}),
        }


def install_dashboard(app: FastAPI, engine, model_name: str) -> DashboardStats:
    """Add the dashboard routes and its stats listener to a server app."""
    stats = DashboardStats(model_name)
    engine.add_stats_listener(stats)
    with open(os.path.join(STATIC, "dashboard.html"), encoding="utf-8") as f:
        page = f.read()

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard():
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/data")
    async def dashboard_data():
        m = engine.config.model
        s = engine.config.scheduler
        extra = {"max_model_len": m.max_model_len,
                 "generation_defaults": dict(m.generation_defaults),
                 "target_tpot_ms": s.target_tpot_ms, "target_ttft_ms": s.target_ttft_ms,
                 "max_num_seqs": s.max_num_seqs,
                 "engine_state": engine.state.name.lower()}
        return JSONResponse(stats.snapshot(extra), headers={"Cache-Control": "no-cache"})

    return stats
