"""``kvflow bench embed``: embeddings per second (workload EMB) for kvflow and for
transformers on the same weights, in the same run.

The inputs are random token ids (uniform lengths in [--min-len, --max-len], seed 0), so
no tokenizer is needed and both sides see exactly the same tokens. kvflow runs them all
through ``LLM.embed`` (continuous batching, chunked prefill); transformers runs the base
model in padded batches of --hf-batch-size, sorted by length (the least padding), and
pools the last token, normalized. The result also holds the smallest cosine similarity
between the two sides' embeddings (they must agree).

``--build-random-qwen3 SHAPE`` first writes a random Qwen3 of that shape to --model
(hidden_size x layers, e.g. 512x8) when the folder has no config.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import numpy as np

from kvflow.bench.machine import save_result


def add_embed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a Hugging Face model folder")
    p.add_argument("--num-texts", type=int, default=1000)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--backend", default="kvflow,hf",
                   help="comma-separated: kvflow, hf (transformers), in this order")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--build-random-qwen3", default=None, metavar="HIDDENxLAYERS")
    p.add_argument("--save-result", default=None)


def _build_random_qwen3(folder: str, shape: str) -> None:
    import torch
    import transformers

    hidden, layers = (int(x) for x in shape.lower().split("x"))
    heads = max(hidden // 64, 1)
    config = transformers.Qwen3Config(
        vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 3,
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max(heads // 2, 1), head_dim=64, max_position_embeddings=2048,
        tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    model.save_pretrained(folder)


def _inputs(n: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    g = np.random.default_rng(0)
    return [g.integers(10, vocab, int(k)).tolist() for k in g.integers(lo, hi + 1, n)]


def _run_kvflow(ns, prompts) -> tuple[dict, np.ndarray]:
    from kvflow import LLM

    extra = {}
    if ns.max_num_batched_tokens:
        extra["max_num_batched_tokens"] = ns.max_num_batched_tokens
    llm = LLM(ns.model, device=ns.device, dtype=ns.dtype, kv_cache_memory=ns.kv_cache_memory,
              max_model_len=max(ns.max_len, 16), runner="pooling", pooling_type="last",
              **extra)
    llm.embed(prompts[:4])  # warm up (and build the CPU step)
    start = time.perf_counter()
    outs = llm.embed(prompts)
    seconds = time.perf_counter() - start
    llm.shutdown()
    return {"seconds": seconds}, np.array([o.data for o in outs], dtype=np.float32)


def _run_hf(ns, prompts) -> tuple[dict, np.ndarray]:
    import torch
    import transformers

    device = "cuda" if ns.device == "auto" and torch.cuda.is_available() else (
        "cpu" if ns.device == "auto" else ns.device)
    dtype = torch.float32 if device == "cpu" and ns.dtype == "auto" else (
        torch.bfloat16 if ns.dtype == "auto" else getattr(torch, ns.dtype))
    model = transformers.AutoModel.from_pretrained(ns.model, dtype=dtype).to(device).eval()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out = np.zeros((len(prompts), model.config.hidden_size), dtype=np.float32)

    def run(idx: list[int]) -> None:
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):  # right padding: the last real token is at len - 1
            ids[r, : len(prompts[i])] = torch.tensor(prompts[i])
            mask[r, : len(prompts[i])] = 1
        with torch.inference_mode():
            hidden = model(input_ids=ids.to(device),
                           attention_mask=mask.to(device)).last_hidden_state  # [B, L, H]
            last = hidden[torch.arange(len(idx)), mask.sum(1).to(device) - 1].float()
            vecs = torch.nn.functional.normalize(last, dim=-1).cpu().numpy()
        out[idx] = vecs

    run(order[:4])  # warm up
    start = time.perf_counter()
    for b in range(0, len(order), ns.hf_batch_size):
        run(order[b: b + ns.hf_batch_size])
    seconds = time.perf_counter() - start
    model = None  # free it before the next backend loads
    gc.collect()
    return {"seconds": seconds, "batch_size": ns.hf_batch_size}, out


def run_embed_benchmark(ns: argparse.Namespace) -> dict:
    if ns.build_random_qwen3 and not os.path.isfile(os.path.join(ns.model, "config.json")):
        _build_random_qwen3(ns.model, ns.build_random_qwen3)
    with open(os.path.join(ns.model, "config.json")) as f:
        cfg = json.load(f)
    prompts = _inputs(ns.num_texts, ns.min_len, ns.max_len, cfg["vocab_size"])
    tokens = sum(len(p) for p in prompts)
    runs, vectors = {}, {}
    for name in ns.backend.split(","):
        fn = {"kvflow": _run_kvflow, "hf": _run_hf}[name]
        stats, vecs = fn(ns, prompts)
        stats["embeddings_per_s"] = len(prompts) / stats["seconds"]
        stats["tokens_per_s"] = tokens / stats["seconds"]
        runs[name], vectors[name] = stats, vecs
        print(f"{name}: {stats['embeddings_per_s']:.2f} embeddings/s, "
              f"{stats['tokens_per_s']:.0f} tokens/s ({stats['seconds']:.1f} s)")
    result = {"workload": {"name": "EMB", "num_texts": ns.num_texts, "min_len": ns.min_len,
                           "max_len": ns.max_len, "total_tokens": tokens, "seed": 0,
                           "model": ns.model, "model_shape": {
                               k: cfg.get(k) for k in ("architectures", "hidden_size",
                                                       "num_hidden_layers", "vocab_size")}},
              "runs": runs}
    if "kvflow" in vectors and "hf" in vectors:
        cos = np.sum(vectors["kvflow"] * vectors["hf"], axis=1)
        result["min_cosine_kvflow_vs_hf"] = float(cos.min())
        result["speedup_kvflow_over_hf"] = (runs["kvflow"]["embeddings_per_s"]
                                            / runs["hf"]["embeddings_per_s"])
        print(f"kvflow / hf: {result['speedup_kvflow_over_hf']:.2f}x, min cosine "
              f"{result['min_cosine_kvflow_vs_hf']:.5f}")
    return save_result(ns.save_result, result)
