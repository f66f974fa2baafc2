"""/metrics: the engine's statistics in Prometheus text format.

Names follow vLLM's (``kvflow:`` instead of ``vllm:``) so existing dashboards adapt by a
prefix. Each server has its own registry: nothing global.
"""

from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)

from kvflow.engine.messages import STRUCTURED_FIELDS, CoreStats, spec_totals
from kvflow.engine.stats import IterationStats

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                  0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                  80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class PrometheusMetrics:
    """A StatsListener that keeps Prometheus series for one served model."""

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        self._labels = {"model_name": model_name}

        def gauge(name, doc):
            return Gauge(f"kvflow:{name}", doc, labels, registry=r).labels(**self._labels)

        def counter(name, doc):
            return Counter(f"kvflow:{name}", doc, labels, registry=r).labels(**self._labels)

        def histogram(name, doc, buckets):
            return Histogram(f"kvflow:{name}", doc, labels, buckets=buckets,
                             registry=r).labels(**self._labels)

        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc",
                              "Fraction of KV cache blocks in use (1 = full).")
        self.kv_used = gauge("kv_cache_used_blocks", "KV cache blocks held by requests.")
        self.kv_total = gauge("kv_cache_total_blocks", "KV cache blocks in all.")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate",
                                     "Prompt tokens found in the KV cache / prompt tokens, "
                                     "since start.")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.preemptions = counter("num_preemptions",
                                   "Sequences preempted (KV cache full), since start.")
        self._success = Counter("kvflow:request_success",
                                "Finished sequences by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.ttft = histogram("time_to_first_token_seconds",
                              "Time from arrival to the first token.", _TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Mean time per output token after the first, per sequence.",
                              _TOKEN_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between two outputs of a sequence.", _TOKEN_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Time from arrival to the end of a sequence.", _E2E_BUCKETS)
        # Speculative decoding (names as vLLM's spec_decode counters).
        self.spec_drafts = counter("spec_decode_num_drafts",
                                   "Verification steps of a request with draft tokens.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens",
                                         "Draft tokens verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens",
                                     "Draft tokens accepted.")
        self._spec_per_pos = Counter("kvflow:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in the draft.",
                                     ["model_name", "position"], registry=r)
        self.spec_proposals = counter("spec_decode_num_proposals",
                                      "Proposer runs (each drafts for the whole batch).")
        self.spec_draft_time = counter("spec_decode_draft_time_seconds",
                                       "Time the proposer ran.")
        self.spec_verify_steps = counter("spec_decode_num_verify_steps",
                                         "Engine steps that verified draft tokens.")
        self.spec_verify_time = counter("spec_decode_verify_time_seconds",
                                        "Time of verification steps, from launch until "
                                        "their tokens reached the host.")
        self._spec_last = spec_totals(None)
        # Constrained decoding (CoreStats.structured, in STRUCTURED_FIELDS order).
        self._structured = [counter(metric, doc) for _, metric, doc in STRUCTURED_FIELDS]
        self._structured_last = [0.0] * len(STRUCTURED_FIELDS)
        self._spec_pos_last: list[int] = []
        for reason in ("stop", "length", "abort"):
            self._success.labels(finished_reason=reason, **self._labels)
        self._queries = 0
        self._hits = 0
        self._preemptions = 0

    def record(self, core: CoreStats | None, it: IterationStats | None) -> None:
        if core is not None:
            self.running.set(core.num_running)
            self.waiting.set(core.num_waiting)
            self.kv_usage.set(core.kv_cache_usage)
            self.kv_used.set(core.num_used_blocks)
            self.kv_total.set(core.num_blocks)
            if core.num_preemptions > self._preemptions:
                self.preemptions.inc(core.num_preemptions - self._preemptions)
                self._preemptions = core.num_preemptions
            if core.spec_num_drafts or core.spec_num_proposals:
                self._record_spec(core)
            for i, new in enumerate(core.structured):
                if new > self._structured_last[i]:
                    self._structured[i].inc(new - self._structured_last[i])
                    self._structured_last[i] = new
        if it is None:
            return
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        if it.prefix_cache_queries:
            self._queries += it.prefix_cache_queries
            self._hits += it.prefix_cache_hits
            self.prefix_queries.inc(it.prefix_cache_queries)
            self.prefix_hits.inc(it.prefix_cache_hits)
            self.prefix_hit_rate.set(self._hits / self._queries)
        for v in it.ttfts_s:
            self.ttft.observe(v)
        for v in it.itls_s:
            self.itl.observe(v)
        for f in it.finished:
            self._success.labels(finished_reason=f.finish_reason, **self._labels).inc()
            self.e2e.observe(f.e2e_s)
            if f.tpot_s is not None:
                self.tpot.observe(f.tpot_s)

    def _record_spec(self, core: CoreStats) -> None:
        now = spec_totals(core)
        for series, new, old in zip((self.spec_drafts, self.spec_draft_tokens,
                                     self.spec_accepted, self.spec_proposals,
                                     self.spec_draft_time, self.spec_verify_steps,
                                     self.spec_verify_time), now, self._spec_last):
            if new > old:
                series.inc(new - old)
        self._spec_last = now
        for pos, count in enumerate(core.spec_accepted_per_pos):
            old = self._spec_pos_last[pos] if pos < len(self._spec_pos_last) else 0
            series = self._spec_per_pos.labels(position=str(pos), **self._labels)
            if count > old:
                series.inc(count - old)
        self._spec_pos_last = list(core.spec_accepted_per_pos)

    def render(self) -> bytes:
        return generate_latest(self.registry)
