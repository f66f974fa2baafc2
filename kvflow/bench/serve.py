"""``kvflow bench serve``: replay a dataset against any OpenAI-compatible server.

Requests go to ``/v1/completions`` with the prompt as token ids (no tokenizer needed on
the client), ``ignore_eos`` so output lengths are exact, and ``stream`` so the time to
the first token and between tokens can be measured. Arrivals follow a Poisson process
(``--request-rate``), or a gamma process with ``--burstiness`` != 1, as in vLLM's
benchmark; ``--max-concurrency`` caps requests in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from kvflow import envs
from kvflow.bench.datasets import BenchRequest, length_range, random_requests
from kvflow.bench.machine import save_result
from kvflow.entrypoints.utils import normalize_base_url, raise_fd_limit

# Above this share of prompt tokens found in the server's prefix cache, say so.
PREFIX_HIT_WARNING = 0.1


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server URL (without /v1)")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="model name sent in requests (default: the "
                   "server's first model in /v1/models)")
    p.add_argument("--api-key", default=None, help="default: $KVFLOW_API_KEY")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary to draw random prompt tokens from (default: from the "
                   "model's config, when kvflow can resolve the model name)")
    p.add_argument("--dataset", choices=["random"], default="random")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len * (1 - r), len * (1 + r)]")
    p.add_argument("--min-input-len", type=int, default=None)
    p.add_argument("--max-input-len", type=int, default=None)
    p.add_argument("--min-output-len", type=int, default=None)
    p.add_argument("--max-output-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fresh-prompts", action="store_true",
                   help="draw new random prompts for this run (a random seed, recorded in "
                   "the result) instead of --seed's: a second run against the same server "
                   "then measures prefill, not its prefix cache")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival times: 1 = Poisson, < 1 burstier, "
                   "> 1 more regular")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--num-warmups", type=int, default=1,
                   help="requests sent (and not measured) before the run")
    p.add_argument("--request-timeout", type=float, default=6 * 3600)
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="service-level objectives for goodput (requests per second that "
                   "meet all of them), e.g. --goodput ttft:2000 tpot:80; keys: ttft, "
                   "tpot, e2el")
    p.add_argument("--save-result", default=None, help="write the result JSON here")
    p.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE",
                   help="recorded in the result JSON (repeatable), e.g. "
                   "server='kvflow serve llama-3.1-8b --load-format dummy'")


def _vocab(ns, model: str) -> tuple[int, set[int]]:
    """Vocabulary size and special token ids to avoid, from the model's configuration."""
    if ns.vocab_size is not None:
        return ns.vocab_size, set()
    from kvflow.errors import KvflowError
    from kvflow.models.registry import resolve_model

    try:
        arch = resolve_model(model, "dummy").arch
    except KvflowError as e:
        raise SystemExit(f"cannot tell the vocabulary size of {model!r} ({e}); pass "
                         f"--vocab-size") from None
    special = set(arch.eos_token_ids)
    if arch.bos_token_id is not None:
        special.add(arch.bos_token_id)
    return arch.vocab_size, special


async def _get_models(session, base_url: str, headers: dict) -> list[dict]:
    async with session.get(f"{base_url}/v1/models", headers=headers) as resp:
        if resp.status != 200:
            raise SystemExit(f"GET /v1/models answered {resp.status}: {await resp.text()}")
        return (await resp.json())["data"]


async def send_request(session, url: str, headers: dict, model: str, req: BenchRequest,
                       temperature: float) -> RequestResult:
    """One streamed completion; times the first chunk and the gaps between chunks."""
    result = RequestResult(prompt_len=len(req.prompt_token_ids))
    payload = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len,
               "temperature": temperature, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return result
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", str(chunk["error"]))
                    return result
                now = time.perf_counter()
                if chunk.get("choices"):
                    if result.ttft_s == 0.0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
        result.latency_s = last - start
        if not result.output_tokens:  # a server that sends no usage: count chunks
            result.output_tokens = len(result.itl_s) + 1
        result.success = result.ttft_s > 0
        if not result.success:
            result.error = "the stream carried no tokens"
    except Exception as e:  # network errors, timeouts: a failed request, not a crash
        result.error = f"{type(e).__name__}: {e}"
    return result


async def _arrivals(requests: list[BenchRequest], rate: float, burstiness: float,
                    rng: np.random.Generator):
    for i, req in enumerate(requests):
        yield req
        if math.isinf(rate) or i == len(requests) - 1:
            continue
        await asyncio.sleep(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))


def _stats_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    a = np.asarray(values) * 1000
    return {"mean": float(a.mean()), "median": float(np.median(a)),
            "p99": float(np.percentile(a, 99))}


_SLO_KEYS = ("ttft", "tpot", "e2el")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:2000", "tpot:80"]`` -> {"ttft": 2.0, "tpot": 0.08} (seconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, _, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if key not in _SLO_KEYS or ms <= 0:
            raise SystemExit(f"--goodput takes KEY:MS with KEY in {', '.join(_SLO_KEYS)} "
                             f"and MS > 0, got {item!r}")
        slos[key] = ms / 1e3
    return slos


def _tpot(r: RequestResult) -> float:
    return (r.latency_s - r.ttft_s) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0


def meets(r: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft_s, "tpot": _tpot(r), "e2el": r.latency_s}
    return r.success and all(values[k] <= v for k, v in slos.items())


def summarize(results: list[RequestResult], duration: float,
              slos: dict[str, float] | None = None) -> dict:
    ok = [r for r in results if r.success]
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    tpots = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok
             if r.output_tokens > 1]
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration,
        "ttft_ms": _stats_ms([r.ttft_s for r in ok]),
        "tpot_ms": _stats_ms(tpots),
        "itl_ms": _stats_ms([x for r in ok for x in r.itl_s]),
        "e2el_ms": _stats_ms([r.latency_s for r in ok]),
        "errors": sorted({r.error for r in results if not r.success})[:5],
        **({"goodput": {"slo_ms": {k: v * 1e3 for k, v in slos.items()},
                        "requests_meeting": sum(meets(r, slos) for r in results),
                        "request_goodput": sum(meets(r, slos) for r in results) / duration}}
           if slos else {}),
    }


def format_result(s: dict, rate: float, max_concurrency: int | None) -> str:
    w = 40
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             f"{'Successful requests:':<{w}}{s['completed']:<10}",
             f"{'Failed requests:':<{w}}{s['failed']:<10}",
             f"{'Request rate configured (RPS):':<{w}}{rate:<10.2f}",
             f"{'Maximum request concurrency:':<{w}}{max_concurrency}",
             f"{'Benchmark duration (s):':<{w}}{s['duration_s']:<10.2f}",
             f"{'Total input tokens:':<{w}}{s['total_input_tokens']:<10}",
             f"{'Total generated tokens:':<{w}}{s['total_output_tokens']:<10}",
             f"{'Request throughput (req/s):':<{w}}{s['request_throughput']:<10.2f}",
             f"{'Output token throughput (tok/s):':<{w}}{s['output_throughput']:<10.2f}",
             f"{'Total token throughput (tok/s):':<{w}}{s['total_token_throughput']:<10.2f}"]
    for key, title, short in (("ttft_ms", "Time to First Token", "TTFT"),
                              ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl_ms", "Inter-token Latency", "ITL"),
                              ("e2el_ms", "End-to-end Latency", "E2EL")):
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            lines.append(f"{f'{label} {short} (ms):':<{w}}{s[key][stat]:<10.2f}")
    if "goodput" in s:
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in s["goodput"]["slo_ms"].items())
        lines.append(f"{'Request goodput (req/s):':<{w}}{s['goodput']['request_goodput']:<.2f}"
                     f" ({s['goodput']['requests_meeting']} requests with {slo})")
    if "server_prefix_cache_hit_rate" in s:
        lines.append(f"{'Prefix cache hit rate (server):':<{w}}"
                     f"{100 * s['server_prefix_cache_hit_rate']:<.1f}%")
    lines.append("=" * 50)
    for err in s["errors"]:
        lines.append(f"error: {err}")
    return "\n".join(lines)


_METRIC_LINE = re.compile(r"^([^\s{]+)(?:\{[^}]*\})?\s+(\S+)")


def prefix_cache_counters(metrics_text: str) -> tuple[float, float] | None:
    """(prompt tokens looked up, tokens found) from a Prometheus page that has the
    ``<engine>:prefix_cache_queries`` and ``..._hits`` counters (kvflow's, vLLM's)."""
    found: dict[str, float] = {}
    for line in metrics_text.splitlines():
        m = _METRIC_LINE.match(line)
        if m is None or line.startswith("#"):
            continue
        for kind in ("queries", "hits"):
            if m.group(1).endswith(f":prefix_cache_{kind}_total"):
                found[kind] = found.get(kind, 0.0) + float(m.group(2))
    if len(found) < 2:
        return None
    return found["queries"], found["hits"]


async def _scrape_prefix_cache(session, base: str, headers: dict) -> tuple[float, float] | None:
    try:
        async with session.get(base + "/metrics", headers=headers) as resp:
            return prefix_cache_counters(await resp.text()) if resp.status == 200 else None
    except Exception:  # an endpoint without metrics: the figure is simply not reported
        return None


async def run_benchmark(ns: argparse.Namespace) -> dict:
    import aiohttp

    base = normalize_base_url(ns.base_url)
    api_key = ns.api_key or envs.api_key()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=ns.request_timeout)
    connector = aiohttp.TCPConnector(limit=ns.max_concurrency or 0, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector,
                                     read_bufsize=1 << 20) as session:
        cards = await _get_models(session, base, headers)
        model = ns.model or cards[0]["id"]
        card = next((c for c in cards if c["id"] == model), {})
        vocab, special = _vocab(ns, model)
        in_rng = length_range(ns.input_len, ns.range_ratio, ns.min_input_len,
                              ns.max_input_len)
        out_rng = length_range(ns.output_len, ns.range_ratio, ns.min_output_len,
                               ns.max_output_len)
        seed = int.from_bytes(os.urandom(4), "little") if ns.fresh_prompts else ns.seed
        # Fresh prompts: the warm-up gets a prompt of its own (the extra last one), so no
        # measured prompt is cached by it either.
        requests = random_requests(ns.num_prompts + bool(ns.fresh_prompts), in_rng, out_rng,
                                   vocab, seed, special)
        warm_req = requests.pop() if ns.fresh_prompts else requests[0]
        url = base + ns.endpoint
        for _ in range(ns.num_warmups):
            warm = BenchRequest(warm_req.prompt_token_ids, min(warm_req.output_len, 16))
            r = await send_request(session, url, headers, model, warm, ns.temperature)
            if not r.success:
                raise SystemExit(f"the warm-up request failed: {r.error}")
        print(f"{len(requests)} requests to {url} (model {model}), rate {ns.request_rate} "
              f"req/s, burstiness {ns.burstiness}, max concurrency {ns.max_concurrency}",
              flush=True)
        before = await _scrape_prefix_cache(session, base, headers)
        sem = asyncio.Semaphore(ns.max_concurrency) if ns.max_concurrency else None

        async def limited(req: BenchRequest) -> RequestResult:
            if sem is None:
                return await send_request(session, url, headers, model, req, ns.temperature)
            async with sem:
                return await send_request(session, url, headers, model, req, ns.temperature)

        rng = np.random.default_rng(seed)
        bar = None if envs.no_progress_bar() else tqdm(total=len(requests), unit="req",
                                                       desc="requests", file=sys.stderr)
        start = time.perf_counter()
        tasks = []
        async for req in _arrivals(requests, ns.request_rate, ns.burstiness, rng):
            task = asyncio.create_task(limited(req))
            if bar is not None:
                task.add_done_callback(lambda _: bar.update(1))
            tasks.append(task)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
        after = await _scrape_prefix_cache(session, base, headers)
    summary = summarize(results, duration, parse_goodput(ns.goodput))
    if before is not None and after is not None and after[0] > before[0]:
        # A warm cache (the same prompts sent before) makes prefill nearly free: the
        # figures would not describe this workload, so the hit rate goes with them.
        summary["server_prefix_cache_hit_rate"] = (after[1] - before[1]) / (after[0] -
                                                                            before[0])
        if summary["server_prefix_cache_hit_rate"] > PREFIX_HIT_WARNING:
            print(f"warning: {100 * summary['server_prefix_cache_hit_rate']:.0f}% of the "
                  f"prompt tokens were found in the server's prefix cache (these prompts "
                  f"were sent to it before): prefill was nearly free and the figures flatter "
                  f"it. Restart the server or pass --fresh-prompts.", file=sys.stderr)
    summary["workload"] = {
        "dataset": ns.dataset, "num_prompts": len(requests),
        "input_len_range": list(in_rng), "output_len_range": list(out_rng),
        "request_rate": ns.request_rate if not math.isinf(ns.request_rate) else "inf",
        "burstiness": ns.burstiness, "max_concurrency": ns.max_concurrency,
        "temperature": ns.temperature, "seed": seed, "fresh_prompts": ns.fresh_prompts,
        "vocab_size": vocab}
    summary["server"] = {"base_url": base, "endpoint": ns.endpoint, "model": model,
                         "max_model_len": card.get("max_model_len")}
    summary["metadata"] = dict(kv.split("=", 1) for kv in ns.metadata)
    return summary


def run_serve_benchmark(ns: argparse.Namespace) -> int:
    if ns.request_rate <= 0 or ns.burstiness <= 0:
        raise SystemExit("--request-rate and --burstiness must be > 0")
    if any("=" not in kv for kv in ns.metadata):
        raise SystemExit("--metadata takes KEY=VALUE")
    parse_goodput(ns.goodput)  # a bad objective fails before any request is sent
    raise_fd_limit()
    summary = asyncio.run(run_benchmark(ns))
    print(format_result(summary, ns.request_rate, ns.max_concurrency))
    if ns.save_result:
        save_result(ns.save_result, summary)
    return 0 if summary["completed"] else 1
