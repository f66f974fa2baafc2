"""``kvflow bench quality``: what a weight format costs in accuracy, on a fixed text.

The text is cut into windows of ``--context`` tokens; each window is one prefill. As
llama.cpp's perplexity tool does, only the second half of each window is scored (every
scored token has at least half a window of context). Per scored token we compare the
next-token distribution of each method with the dense model's (``--quantization none``)
on the same tokens: perplexity, KL(dense || method) mean / p99 / max, and top-1 agreement.
A method ``kv-int8`` / ``kv-fp8`` keeps the dense weights and quantizes the KV cache
instead (``--kv-cache-dtype``): every window's keys and values are stored quantized and
attention reads them back, so the figures are what the cache's rounding costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import TYPE_CHECKING

import numpy as np

from kvflow.bench.machine import save_result
from kvflow.engine.args import EngineArgs
from kvflow.errors import InvalidParameterError

if TYPE_CHECKING:
    import torch

DEFAULT_TEXT = os.path.join(os.path.dirname(__file__), "data", "quality_text.txt")


def add_quality_args(p: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(p, model_positional=False)
    p.add_argument("--methods", default="gguf,int8,int4",
                   help="comma-separated --quantization values to compare with the dense "
                   "model (none); int4 takes --quantization-group-size/-symmetric, or "
                   "int4-g64, int4-g128-sym; gguf-int8act / gguf-f32act: GGUF on the C++ "
                   "CPU step's GEMV with int8 / float32 activations; kv-int8 and kv-fp8: "
                   "dense weights with a "
                   "quantized KV cache; a directory: a pre-quantized checkpoint of the same "
                   "model (e.g. written by kvflow quantize), scored against the dense "
                   "--model")
    p.add_argument("--text", default=DEFAULT_TEXT, help="UTF-8 text file to score "
                   "(default: the text shipped with kvflow)")
    p.add_argument("--context", type=int, default=256, help="tokens per window")
    p.add_argument("--max-windows", type=int, default=None, help="score at most this many")
    p.add_argument("--save-result", default=None, help="write the result JSON here")


def method_args(base: EngineArgs, method: str) -> EngineArgs:
    """'int4-g64-sym' -> EngineArgs with quantization=int4, group 64, symmetric;
    'kv-int8' -> dense weights (the reference's) with an int8 KV cache."""
    if method.startswith("kv-"):
        return dataclasses.replace(base, quantization="none",
                                   kv_cache_dtype=method.removeprefix("kv-"))
    from kvflow.layers.quantization.config import USER_METHODS

    if method in USER_METHODS:  # names with a dash (fp8-block, w8a8-int8, llm-int8)
        return dataclasses.replace(base, quantization=method)
    if os.path.isdir(method):  # a pre-quantized checkpoint (e.g. of `kvflow quantize`)
        return dataclasses.replace(base, model=method, quantization="auto")
    name, *opts = method.split("-")
    changes: dict = {"quantization": name}
    for o in opts:
        if o.startswith("g") and o[1:].isdigit():
            changes["quantization_group_size"] = int(o[1:])
        elif o == "sym":
            changes["quantization_symmetric"] = True
        else:
            raise InvalidParameterError(f"unknown option {o!r} in method {method!r}",
                                        param="methods")
    return dataclasses.replace(base, **changes)


class _Scorer:
    """One model, prefilling a window at a time through its own small KV cache."""

    def __init__(self, args: EngineArgs, context: int) -> None:
        from kvflow.layers.attention import Attention, get_attention_backend, model_rotary
        from kvflow.layers.attention.metadata import AttentionSpec
        from kvflow.models.loader import load_model, weight_bytes

        import torch  # here, not at the top: `kvflow plan` builds this parser without torch

        self.config = args.create_engine_config()
        self.device = torch.device(self.config.device.device)
        start = time.perf_counter()
        backend = get_attention_backend("torch")
        self.model = load_model(self.config.model, self.device, backend)
        self.load_s = time.perf_counter() - start
        self.weight_bytes = weight_bytes(self.model)
        arch, bs = self.config.model.arch, self.config.cache.block_size
        self.nblocks = -(-context // bs)
        dtype = next(p for p in self.model.parameters() if p.is_floating_point()).dtype
        self.builder = backend.metadata_builder(AttentionSpec(
            block_size=bs, num_kv_heads=arch.num_key_value_heads, dtype=dtype,
            device=self.device, rotary=model_rotary(self.model)))
        kind = self.config.cache.cache_dtype
        for m in self.model.modules():
            if isinstance(m, Attention):  # [2, blocks, block_size, KVH, D]
                shape = (2, self.nblocks, bs, arch.num_key_value_heads, arch.head_dim)
                if kind == "auto":
                    m.kv_cache = torch.zeros(shape, dtype=dtype, device=self.device)
                    continue
                from kvflow.layers.attention.kv_quant import KVQuant, storage_dtype

                m.kv_cache = torch.zeros(shape, dtype=storage_dtype(kind), device=self.device)
                m.kv_quant = KVQuant(kind, torch.zeros(shape[:-1], device=self.device)
                                     if kind == "int8" else None, m.k_scale, m.v_scale)

    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """[T] token ids -> float32 [T, vocab] log-probabilities of the next token."""
        import torch

        with torch.inference_mode():
            return self._logprobs(torch, ids)

    def _logprobs(self, torch, ids: list[int]) -> torch.Tensor:
        from kvflow.layers.attention import AttentionMetadata

        t, d = len(ids), self.device
        meta = AttentionMetadata(
            num_actual_tokens=t, num_reqs=1, num_decodes=0, max_query_len=t,
            max_seq_len=t, slot_mapping=torch.arange(t, device=d),
            query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=d),
            seq_lens=torch.tensor([t], dtype=torch.int32, device=d),
            block_tables=torch.arange(self.nblocks, dtype=torch.int32, device=d)[None],
            query_start_loc_cpu=[0, t], seq_lens_cpu=[t])
        positions = torch.arange(t, device=d)
        meta = self.builder.build(meta, positions)
        hidden = self.model(torch.tensor(ids, device=d), positions, meta)
        return torch.log_softmax(self.model.compute_logits(hidden).float(), dim=-1).cpu()


def _windows(ns, config) -> list[list[int]]:
    from kvflow.engine.llm_engine import load_tokenizer

    tok = load_tokenizer(config)
    if tok is None:
        raise InvalidParameterError("bench quality needs a model with a tokenizer")
    try:
        with open(ns.text, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise InvalidParameterError(f"cannot read --text {ns.text}: {e}",
                                    param="text") from None
    ids = tok.encode(text, add_special_tokens=False)
    if ns.context < 16:
        raise InvalidParameterError("--context must be >= 16", param="context")
    wins = [ids[i:i + ns.context] for i in range(0, len(ids) - ns.context + 1, ns.context)]
    if ns.max_windows:
        wins = wins[:ns.max_windows]
    if not wins:
        raise InvalidParameterError(f"the text has {len(ids)} tokens, fewer than one "
                                    f"window of --context {ns.context}", param="text")
    return wins


def run_quality(ns: argparse.Namespace) -> int:
    import torch

    base = EngineArgs.from_cli_args(ns)
    methods = [m.strip() for m in ns.methods.split(",") if m.strip()]
    ref = _Scorer(dataclasses.replace(base, quantization="none"), ns.context)
    wins = _windows(ns, ref.config)
    half = ns.context // 2
    ref_lp = [ref.logprobs(w)[half:-1] for w in wins]  # scored positions only
    targets = torch.cat([torch.tensor(w[half + 1:]) for w in wins])
    table = {"none": _figures(torch.cat(ref_lp), None, targets, ref)}
    del ref
    for m in methods:
        # gguf-int8act / gguf-f32act: GGUF with every linear on the C++ step's GEMV
        # (int8 or float32 activations), the numerics of a CPU decode step.
        gemv = next((g for g in ("int8act", "f32act") if m.endswith("-" + g)), None)
        scorer = _Scorer(method_args(base, m.removesuffix(f"-{gemv}") if gemv else m),
                         ns.context)
        if gemv:
            from kvflow.cpu.step import use_step_gemv

            use_step_gemv(scorer.model, int8=gemv == "int8act")
        lp = torch.cat([scorer.logprobs(w)[half:-1] for w in wins])
        table[m] = _figures(lp, torch.cat(ref_lp), targets, scorer)
        if scorer.config.model.quantization == "llm-int8":
            from kvflow.layers.quantization.llm_int8 import format_summary, outlier_summary

            table[m]["outlier_columns"] = summary = outlier_summary(reset=True)
            print(f"{m}: outlier input columns per call: {format_summary(summary)}")
        del scorer
    print(f"{len(wins)} windows of {ns.context} tokens, {len(targets)} scored tokens")
    print(f"{'method':<16}{'weights MiB':>12}{'PPL':>9}{'KL mean':>10}{'KL p99':>9}"
          f"{'top-1 %':>9}")
    for m, f in table.items():
        kl = f.get("kl_mean")
        print(f"{m:<16}{f['weight_mib']:>12.1f}{f['perplexity']:>9.3f}"
              + (f"{kl:>10.5f}{f['kl_p99']:>9.4f}{100 * f['top1_agreement']:>9.2f}"
                 if kl is not None else ""))
    result = {"workload": {"text": os.path.basename(ns.text), "context": ns.context,
                           "windows": len(wins), "scored_tokens": len(targets),
                           "model": base.model},
              "methods": table, "loadavg": list(os.getloadavg())}
    save_result(ns.save_result, result)
    return 0


def _figures(lp: torch.Tensor, ref: torch.Tensor | None, targets: torch.Tensor,
             scorer: _Scorer) -> dict:
    import torch

    nll = -lp.gather(1, targets[:, None]).squeeze(1)
    out = {"perplexity": float(torch.exp(nll.mean())),
           "weight_mib": scorer.weight_bytes / 2**20, "load_s": scorer.load_s,
           "quantization": scorer.config.model.quantization,
           "kv_cache_dtype": scorer.config.cache.cache_dtype,
           "weights": (scorer.model.quant_config.describe()
                       if getattr(scorer.model, "quant_config", None) else "dense")}
    if ref is not None:
        kl = (ref.exp() * (ref - lp)).sum(-1)  # KL(dense || method) per token
        out.update(kl_mean=float(kl.mean()), kl_p99=float(np.percentile(kl.numpy(), 99)),
                   kl_max=float(kl.max()),
                   top1_agreement=float((lp.argmax(-1) == ref.argmax(-1)).float().mean()))
    return out
