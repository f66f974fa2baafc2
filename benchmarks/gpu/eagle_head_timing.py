#!/usr/bin/env python
"""Cost of the ``eagle_mlp`` proposer's drafting at Llama-3.1-8B shape on the GPU.

The speculative prediction (scripts/predict_spec_speedup.py) needs what one draft costs
beside the verification step. This times ``EagleMlpProposer.draft`` itself, eagerly as
the engine runs it, with random weights of the shape a head for the 8B target would have:
hidden 4096, vocabulary 128256, a 4096-token draft vocabulary and the MLP width in the
same ratio to the hidden size as the SmolLM2 head that ``kvflow train-eagle`` makes
(768 / 576). Random weights give the time, not the acceptance.

    python benchmarks/gpu/eagle_head_timing.py --out eagle-head.json
"""

from __future__ import annotations

import argparse
import time

import torch

from kvflow.bench.machine import save_result
from kvflow.spec_decode.eagle_mlp import EagleMlpHead, EagleMlpProposer
from kvflow.spec_decode.heads_config import EagleMlpConfig


def make_proposer(hidden: int, vocab: int, draft_vocab: int, inter: int, min_conf: float,
                  k: int, device: torch.device, dtype: torch.dtype) -> EagleMlpProposer:
    cfg = EagleMlpConfig(hidden, vocab, draft_vocab, inter)
    head = EagleMlpHead(cfg)
    head.vocab.copy_(torch.randperm(vocab)[:draft_vocab])
    head = head.to(device=device)
    for p in head.parameters():
        p.data = (p.data.to(dtype) * 0.02) if p.dim() > 1 else p.data.to(dtype)
    prop = object.__new__(EagleMlpProposer)  # its state without a target model to read
    prop.min_confidence = min_conf
    prop.num_speculative_tokens = k
    prop.head = head.eval()
    prop.vocab = head.vocab
    prop.lm_rows = torch.randn(draft_vocab, hidden, device=device, dtype=dtype) * 0.02
    prop.embed = torch.nn.Embedding(vocab, hidden, device=device, dtype=dtype)
    prop.device = device
    return prop


def time_draft(prop: EagleMlpProposer, k: int, hidden: int, iters: int) -> float:
    device = prop.device
    h = torch.randn(1, hidden, device=device, dtype=prop.lm_rows.dtype)
    last = torch.tensor([17], device=device)
    for _ in range(5):
        prop.draft(h, last, k)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        drafts, keep = prop.draft(h, last, k)
        keep.tolist()  # the engine reads the proposals on the host
    sync()
    return (time.perf_counter() - t0) / iters * 1000


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", default="cuda")
    ns = ap.parse_args()
    device = torch.device(ns.device)
    inter = round(ns.hidden * 768 / 576 / 64) * 64
    rows = []
    with torch.inference_mode():
        for conf in (0.0, 0.6):
            for k in [int(x) for x in ns.ks.split(",")]:
                prop = make_proposer(ns.hidden, ns.vocab, ns.draft_vocab, inter, conf, k,
                                     device, torch.bfloat16)
                ms = time_draft(prop, k, ns.hidden, ns.iters)
                rows.append({"k": k, "draft_confidence": conf, "ms_per_propose": round(ms, 3),
                             "ms_per_draft_token": round(ms / k, 3)})
                print(f"eagle_mlp k={k} draft_confidence={conf}: {ms:.3f} ms per proposal")
    result = {"script": "benchmarks/gpu/eagle_head_timing.py", "what": "eagle_mlp proposer drafting cost, batch 1, eager, random weights",
              "hidden_size": ns.hidden, "vocab_size": ns.vocab,
              "draft_vocab_size": ns.draft_vocab, "intermediate_size": inter,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "rows": rows}
    save_result(ns.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
