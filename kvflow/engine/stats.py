"""Serving statistics gathered in the API process: latencies per sequence, token counts,
and the periodic log line. /metrics (Prometheus) reads the same records.

Times are ``time.monotonic()`` seconds, taken when the API process receives a step's
outputs, so they include everything a client waits for except the HTTP write.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvflow.engine.messages import CoreStats, spec_totals
from kvflow.logger import init_logger

logger = init_logger(__name__)


@dataclass
class FinishedSequence:
    """One finished sample (an n > 1 request finishes n of them)."""

    finish_reason: str  # stop, length or abort
    e2e_s: float
    ttft_s: float | None  # None when no token was produced
    tpot_s: float | None  # mean time per output token after the first; None below 2 tokens
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What changed between two output batches of the engine core."""

    num_prompt_tokens: int = 0  # prompts whose first token arrived (once per request)
    num_generation_tokens: int = 0
    prefix_cache_queries: int = 0  # prompt tokens of sequences that started (per sample)
    prefix_cache_hits: int = 0  # of those, tokens found in the cache
    ttfts_s: list[float] = field(default_factory=list)
    itls_s: list[float] = field(default_factory=list)  # gap between a sequence's outputs
    finished: list[FinishedSequence] = field(default_factory=list)
    step_s: float = 0.0  # the engine step that produced these outputs (core process)
    api_s: float = 0.0  # detokenizing and dispatching them (API process)


class StatsListener(Protocol):
    def record(self, core: CoreStats | None, iteration: IterationStats | None) -> None: ...


@dataclass
class _SeqTimes:
    arrival: float
    first: float | None = None
    last: float | None = None
    num_tokens: int = 0


class SequenceTracker:
    """Follows each engine-core sequence from arrival to finish."""

    def __init__(self) -> None:
        self._seqs: dict[str, _SeqTimes] = {}

    def on_outputs(self, outputs, entries, now: float) -> IterationStats:
        """``entries[i]`` is the OutputProcessor's (RequestState, SampleState) of
        ``outputs[i]``, or None when that sample had already ended (aborted, or stopped by
        a stop string) before these outputs; the states are read after processing."""
        it = IterationStats()
        for out, entry in zip(outputs, entries):
            if entry is None:
                continue
            state, sample = entry
            seq = self._seqs.get(out.req_id)
            if seq is None:
                seq = self._seqs[out.req_id] = _SeqTimes(state.metrics.arrival_time)
            n = len(out.new_token_ids)
            if n:
                if seq.first is None:
                    seq.first = now
                    prompt_len = len(state.prompt_token_ids)
                    it.ttfts_s.append(now - seq.arrival)
                    it.prefix_cache_queries += prompt_len
                    it.prefix_cache_hits += out.num_cached_tokens
                    if sample.index == 0:
                        it.num_prompt_tokens += prompt_len
                else:
                    it.itls_s.append(now - seq.last)
                seq.last = now
                seq.num_tokens += n
                it.num_generation_tokens += n
            if sample.finish_reason is not None:
                it.finished.append(self._finish(out.req_id, seq, sample.finish_reason,
                                                len(state.prompt_token_ids), now))
        return it

    def on_abort(self, state, child_ids: list[str], now: float) -> IterationStats:
        """Sequences of ``state`` (a RequestState) ended by an abort."""
        it = IterationStats()
        for cid in child_ids:
            seq = self._seqs.get(cid) or _SeqTimes(state.metrics.arrival_time)
            it.finished.append(self._finish(cid, seq, "abort", len(state.prompt_token_ids),
                                            now))
        return it

    def forget(self, child_ids: list[str]) -> None:
        for cid in child_ids:
            self._seqs.pop(cid, None)

    def _finish(self, cid: str, seq: _SeqTimes, reason: str, prompt_len: int,
                now: float) -> FinishedSequence:
        self._seqs.pop(cid, None)
        ttft = None if seq.first is None else seq.first - seq.arrival
        tpot = None
        if seq.num_tokens > 1 and seq.first is not None and seq.last is not None:
            tpot = (seq.last - seq.first) / (seq.num_tokens - 1)
        return FinishedSequence(reason, now - seq.arrival, ttft, tpot, prompt_len,
                                seq.num_tokens)


class LoggingStatsListener:
    """Logs throughput and scheduler state every ``interval_s`` while the engine is busy."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._core: CoreStats | None = None
        self._prompt_tokens = 0
        self._gen_tokens = 0
        self._queries = 0
        self._hits = 0
        self._last_log: float | None = None
        self._last_preemptions = 0
        self._steps = 0
        self._step_s = 0.0
        self._api_s = 0.0
        self._last_spec = spec_totals(None)  # at the last log

    def record(self, core: CoreStats | None, iteration: IterationStats | None) -> None:
        if core is not None:
            self._core = core
        if iteration is not None:
            self._prompt_tokens += iteration.num_prompt_tokens
            self._gen_tokens += iteration.num_generation_tokens
            self._queries += iteration.prefix_cache_queries
            self._hits += iteration.prefix_cache_hits
            if iteration.step_s:
                self._steps += 1
                self._step_s += iteration.step_s
                self._api_s += iteration.api_s

    def _spec_part(self, core: CoreStats) -> str:
        """Speculative decoding over the interval: acceptance rate, tokens per
        verification step, time per proposer run and per verification step, and
        per-position acceptance since start."""
        now = spec_totals(core)
        drafts, tokens, accepted, proposals, draft_s, verifies, verify_s = (
            a - b for a, b in zip(now, self._last_spec))
        self._last_spec = now
        if not tokens:
            return ", spec decode: no drafts"
        per_pos = ", ".join(f"{a / core.spec_num_drafts:.2f}"
                            for a in core.spec_accepted_per_pos)
        times = ""
        if proposals:
            times += f", draft {1000 * draft_s / proposals:.2f} ms"
        if verifies:
            times += f", verify step {1000 * verify_s / verifies:.1f} ms"
        return (f", spec decode: acceptance {100 * accepted / tokens:.1f}%, "
                f"mean accepted length {1 + accepted / drafts:.2f}, "
                f"drafts {tokens}{times}, accepted per position [{per_pos}]")

    def log(self, now: float) -> str | None:
        """Log (and return) the line for the interval that ends now, if anything ran."""
        if self._last_log is None:
            self._last_log = now
            return None
        elapsed = max(now - self._last_log, 1e-9)
        core = self._core
        busy = core is not None and (core.num_running or core.num_waiting)
        if not busy and not self._prompt_tokens and not self._gen_tokens:
            self._last_log = now
            return None
        preemptions = core.num_preemptions if core is not None else 0
        hit_rate = self._hits / self._queries if self._queries else 0.0
        line = (f"prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
                f"generation throughput: {self._gen_tokens / elapsed:.1f} tokens/s, "
                f"running: {core.num_running if core else 0} reqs, "
                f"waiting: {core.num_waiting if core else 0} reqs, "
                f"KV cache usage: {100 * (core.kv_cache_usage if core else 0):.1f}%, "
                f"prefix cache hit rate: {100 * hit_rate:.1f}%, "
                f"preemptions: {preemptions - self._last_preemptions} "
                f"(total {preemptions})")
        if self._steps:
            line += (f", engine step: {1000 * self._step_s / self._steps:.1f} ms, "
                     f"API per step: {1000 * self._api_s / self._steps:.2f} ms")
        if core is not None and core.spec_num_draft_tokens:
            line += self._spec_part(core)
        logger.info(line)
        self._last_log = now
        self._prompt_tokens = self._gen_tokens = self._queries = self._hits = 0
        self._steps, self._step_s, self._api_s = 0, 0.0, 0.0
        self._last_preemptions = preemptions
        return line
