"""CPU decode of a GGUF mixture of experts: experts kept in their blocks against the same
file with its experts dequantized at load (what kvflow did before ``GGUFMoEMethod``).

A ``qwen3-moe-123m``-shaped GGUF file (Qwen3-30B-A3B's layout scaled down: 32 experts,
top-4, 8 layers) is written with seeded random blocks of one type (Q4_0 or Q4_K: gguf-py
has no Q4_K quantizer, and random blocks with small scales time the same) for every
matrix but the routers and norms. Each mode then runs in its own process (so resident
memory is its own), alternated ``--rounds`` times: load, one warm-up, then batch-1
greedy decode of ``--output-len`` tokens after a ``--input-len`` prompt; decode ms/token
is (time for input+output tokens - time for the prompt and one token) / (output - 1)
(the warm-up leaves the prompt in the prefix cache, so both runs are nearly all decode).
"Dequantized" builds the same engine with the experts' method forced to dequantize into
the model dtype (float32, the CPU default for GGUF); everything else keeps its blocks in
both modes.

    python benchmarks/cpu_moe_gguf.py --types q4_0,q4_k \
        --out benchmarks/results/cpu-moe-gguf-qwen3-123m.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np


def write_file(path: str, qtype_name: str) -> None:
    import gguf

    from kvflow.models.registry import PRESETS

    c = PRESETS["qwen3-moe-123m"]
    qt = gguf.GGMLQuantizationType[qtype_name.upper()]
    block, size = gguf.GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(0)
    h, e, i, hd = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"], c["head_dim"]
    nh, nkv, v = c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_expert_feed_forward_length(i)
    w.add_block_count(c["num_hidden_layers"])
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_vocab_size(v)
    w.add_expert_count(e)
    w.add_expert_used_count(c["num_experts_per_tok"])

    def blocks(*shape: int) -> np.ndarray:
        """Random blocks of ``qt`` for a float tensor of ``shape``, scales ~0.002."""
        raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // block * size), np.uint8)
        b = raw.reshape(-1, size)
        scales = np.float16([0.002, 0.002]).view(np.uint8)
        if qt == gguf.GGMLQuantizationType.Q4_K:  # d, dmin
            b[:, :4] = scales
        else:  # Q4_0 / Q8_0: d leads the block
            b[:, :2] = scales[:2]
        return raw

    def mat(name: str, *shape: int) -> None:
        w.add_tensor(name, blocks(*shape), raw_dtype=qt)

    def vec(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, np.float32))

    mat("token_embd.weight", v, h)
    mat("output.weight", v, h)
    vec("output_norm.weight", h)
    for layer in range(c["num_hidden_layers"]):
        p = f"blk.{layer}."
        vec(p + "attn_norm.weight", h)
        vec(p + "ffn_norm.weight", h)
        vec(p + "attn_q_norm.weight", hd)
        vec(p + "attn_k_norm.weight", hd)
        mat(p + "attn_q.weight", nh * hd, h)
        mat(p + "attn_k.weight", nkv * hd, h)
        mat(p + "attn_v.weight", nkv * hd, h)
        mat(p + "attn_output.weight", h, nh * hd)
        w.add_tensor(p + "ffn_gate_inp.weight", rng.normal(0, 0.02, (e, h)).astype(np.float32))
        mat(p + "ffn_gate_exps.weight", e, i, h)
        mat(p + "ffn_up_exps.weight", e, i, h)
        mat(p + "ffn_down_exps.weight", e, h, i)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker(path: str, mode: str, input_len: int, output_len: int) -> dict:
    """One engine in this process: memory after load, decode ms/token."""
    from kvflow import LLM, SamplingParams

    if mode == "dequantized":
        from kvflow.layers.moe import methods

        plain = methods.moe_method
        methods.moe_method = lambda config, prefix: (
            methods.GGUFMoEMethod(dense=True)
            if config is not None and config.method == "gguf" else plain(config, prefix))
    before = rss_mib()
    t0 = time.perf_counter()
    llm = LLM(path, device="cpu", max_model_len=512, skip_tokenizer_init=True,
              kv_cache_memory="64MiB")
    load_s = time.perf_counter() - t0
    runner = llm.engine.core.executor.runner
    moe = runner.model.model.layers[0].mlp.experts
    expert_bytes = sum(t.numel() * t.element_size() for t in moe.parameters())
    prompt = np.random.default_rng(1).integers(3, 16000, input_len).tolist()

    def run(n: int) -> float:
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        llm.generate([prompt], sp, use_tqdm=False)
        return time.perf_counter() - t

    run(output_len)  # warm-up
    first, full = run(1), run(output_len)
    return {"mode": mode, "load_s": round(load_s, 2),
            "rss_after_load_mib": round(rss_mib(), 1),
            "rss_before_load_mib": round(before, 1),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "experts_bytes_per_layer_mib": round(expert_bytes / 2**20, 2),
            "experts_layout": dict(getattr(moe.quant_method, "layouts", {})),
            "decode_ms_per_token": round((full - first) / (output_len - 1) * 1000, 2),
            "prefill_plus_one_s": round(first, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="q4_0,q4_k")
    ap.add_argument("--folder", default="/tmp")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", nargs=2, metavar=("PATH", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.input_len, args.output_len)))
        return
    from kvflow.bench.machine import save_result

    runs = []
    for qtype in args.types.split(","):
        path = os.path.join(args.folder, f"qwen3-moe-123m-{qtype}.gguf")
        if not os.path.isfile(path):
            write_file(path, qtype)
        for r in range(args.rounds):
            for mode in ("kept", "dequantized") if r % 2 == 0 else ("dequantized", "kept"):
                out = subprocess.run(
                    [sys.executable, __file__, "--worker", path, mode, "--input-len",
                     str(args.input_len), "--output-len", str(args.output_len)],
                    check=True, capture_output=True, text=True,
                    env={**os.environ, "KVFLOW_LOG_LEVEL": "WARNING"})
                row = {"type": qtype, "round": r, "file_mib": round(os.path.getsize(path)
                                                                    / 2**20, 1),
                       "loadavg": list(os.getloadavg()), **json.loads(out.stdout.splitlines()[-1])}
                print(json.dumps(row), flush=True)
                runs.append(row)
    save_result(args.out, {"workload": {"model": "qwen3-moe-123m shape, random GGUF blocks",
                                        "batch_size": 1, "input_len": args.input_len,
                                        "output_len": args.output_len,
                                        "rounds": args.rounds},
                           "runs": runs})


if __name__ == "__main__":
    main()
