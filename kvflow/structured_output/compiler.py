"""Grammar compilation against the model's vocabulary, off the engine loop.

A thread pool compiles (xgrammar releases the GIL while it works); the futures are
cached by the constraint's canonical key (``StructuredOutputsParams.key``), so a schema
that many requests share compiles once and later requests find it ready. The cache is
bounded by entries (least recently used go first).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from kvflow.sampling_params import StructuredOutputsParams

# Threads that compile grammars; a compile takes ~15 ms (p50) on the 2-core dev machine
# for the benchmark's schemas (benchmarks/results/so-backends-cpu.json).
COMPILE_THREADS = 2
# Compiled grammars kept (a JSON schema's is tens to hundreds of KB).
CACHE_ENTRIES = 256


@dataclass
class CompileStats:
    """Since start: grammars compiled, their seconds, requests that found theirs in the
    cache, and constraints that failed to compile."""

    num_compiles: int = 0
    compile_s: float = 0.0
    num_cache_hits: int = 0
    num_errors: int = 0


def choice_grammar(choices: list[str]) -> str:
    """GBNF whose sentences are exactly ``choices`` (JSON string escapes are GBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    def __init__(self, tokenizer_info, threads: int = COMPILE_THREADS,
                 cache_entries: int = CACHE_ENTRIES) -> None:
        import xgrammar as xgr

        self._xgr = xgr.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvflow-grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._cache_entries = cache_entries
        self._lock = threading.Lock()
        self.stats = CompileStats()

    def submit(self, so: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar (already done when it was cached)."""
        key = so.key()
        fut = self._cache.get(key)
        if fut is not None and not (fut.done() and fut.exception() is not None):
            self._cache.move_to_end(key)
            with self._lock:
                self.stats.num_cache_hits += 1
            return fut
        fut = self._pool.submit(self._compile, key)
        self._cache[key] = fut
        while len(self._cache) > self._cache_entries:
            self._cache.popitem(last=False)
        return fut

    def _compile(self, key: tuple[str, str]):
        kind, text = key
        start = time.perf_counter()
        try:
            if kind == "json":
                out = self._xgr.compile_json_schema(text, any_whitespace=False,
                                                    strict_mode=True)
            elif kind == "json_object":
                out = self._xgr.compile_json_schema('{"type": "object"}',
                                                    any_whitespace=False)
            elif kind == "regex":
                out = self._xgr.compile_regex(text)
            elif kind == "choice":
                out = self._xgr.compile_grammar(choice_grammar(json.loads(text)))
            else:
                out = self._xgr.compile_grammar(text)
        except Exception:
            with self._lock:
                self.stats.num_errors += 1
            raise
        with self._lock:
            self.stats.num_compiles += 1
            self.stats.compile_s += time.perf_counter() - start
        return out

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
