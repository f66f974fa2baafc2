"""The CPU peer: llama.cpp through ``llama-cpp-python`` on the same GGUF file, greedy.

Optional (``pip install 'kvflow[llamacpp]'`` builds it from source, minutes on 2 cores);
when it is absent the benchmark says so and runs the other backends. The Python package
runs one sequence at a time (llama-server's parallel slots are not in it), so throughput
runs its requests one after another.
"""

from __future__ import annotations

import os
import time

from kvflow.errors import InvalidParameterError


class LlamaCppUnavailable(Exception):
    """llama-cpp-python is not installed (the benchmark skips this backend)."""


def load_llamacpp(config, n_ctx: int):
    """A ``llama_cpp.Llama`` on the model's GGUF file with every core."""
    try:
        import llama_cpp
    except ImportError:
        raise LlamaCppUnavailable("llama-cpp-python is not installed; pip install "
                                  "'kvflow[llamacpp]' (builds llama.cpp from source)") from None
    if config.model.load_format != "gguf":
        raise InvalidParameterError("--backend llamacpp runs GGUF files only; got a "
                                    f"{config.model.load_format} model", param="backend")
    threads = os.cpu_count() or 1
    return llama_cpp.Llama(model_path=config.model.path, n_ctx=n_ctx, n_threads=threads,
                           n_threads_batch=threads, n_batch=512, seed=config.model.seed,
                           verbose=False)


def llamacpp_generate(llm, prompt: list[int], out_len: int, temperature: float) -> int:
    """Decode exactly ``out_len`` tokens after ``prompt`` (past EOS, like ignore_eos);
    the KV cache starts empty each time (no prefix reuse, as in kvflow's latency run)."""
    llm.reset()
    n = 0
    for _ in llm.generate(prompt, temp=temperature, top_k=1 if temperature == 0 else 40,
                          top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        n += 1
        if n >= out_len:
            break
    return n


def llamacpp_latency_runner(config, ns):
    if ns.batch_size != 1:
        raise InvalidParameterError("--backend llamacpp measures one sequence "
                                    "(--batch-size 1)", param="batch_size")
    llm = load_llamacpp(config, n_ctx=min(config.model.max_model_len, 4096))

    def run(prompts, out_len):
        start = time.perf_counter()
        for p in prompts:
            llamacpp_generate(llm, p, out_len, ns.temperature)
        return time.perf_counter() - start
    run.engine = None
    return run


def llamacpp_throughput(config, requests, ns) -> tuple[float, dict]:
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    llm = load_llamacpp(config, n_ctx=longest + 8)
    llamacpp_generate(llm, requests[0].prompt_token_ids[:16], 4, ns.temperature)  # warm-up
    start = time.perf_counter()
    out = sum(llamacpp_generate(llm, r.prompt_token_ids, r.output_len, ns.temperature)
              for r in requests)
    return time.perf_counter() - start, {"output_tokens": out, "mode": "sequential"}
