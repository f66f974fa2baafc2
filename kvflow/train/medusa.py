"""``kvflow train-medusa``: Medusa heads for a frozen base model, by self-distillation.

1. The base model answers a list of prompts (greedy, chat template): the text it would
   generate itself, which is what the heads must predict at serving time.
2. One forward of the base over each prompt + answer gives the last hidden states; they
   are cached, so every epoch after that costs only the heads.
3. Head k learns the token k + 2 places after each answer position (cross-entropy on the
   generated tokens), through the base model's own lm_head (frozen, shared): a head is
   one residual block, hidden x hidden + bias.
4. A tenth of the answers is held out; each head's top-1 / top-5 accuracy on it is
   printed and written into the checkpoint's config.json.

The checkpoint (config.json + medusa_lm_head.safetensors) loads with
``--speculative-config '{"method": "medusa", "model": DIR, "num_speculative_tokens": k}'``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from importlib import resources

import numpy as np
import torch

from kvflow.logger import init_logger
from kvflow.spec_decode.heads_config import MedusaHeadsConfig

logger = init_logger(__name__)


def default_prompts_path() -> str:
    return str(resources.files("kvflow.train") / "data" / "medusa_prompts.txt")


def read_prompts(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        prompts = [line.strip() for line in f if line.strip()]
    if not prompts:
        from kvflow.errors import InvalidParameterError

        raise InvalidParameterError(f"--prompts {path} has no prompts (one per line)",
                                    param="prompts")
    return prompts


@torch.inference_mode()
def last_hidden_states(llm, seqs: list[list[int]]) -> list[torch.Tensor]:
    """The base model's final hidden state at every position of each sequence ([T, H]
    float32 each), one sequence at a time through a scratch KV cache of its own (the
    engine's cache and its cached prefixes are left alone)."""
    from kvflow.layers.attention import AttentionMetadata
    from kvflow.utils import cdiv
    from kvflow.worker import kv_cache as kvc

    runner = llm.engine.core.executor.runner
    model, dev, bs = runner.model, runner.device, runner.block_size
    longest = max(len(s) for s in seqs)
    cache_shape = (runner.kv_caches.shape[0], 2, cdiv(longest, bs), bs,
                   runner.kv_caches.shape[4], runner.kv_caches.shape[5])
    scratch = torch.zeros(cache_shape, dtype=runner.kv_caches.dtype, device=dev)
    kvc.bind_kv_cache(model, scratch)
    # The eager model runs here on a scratch cache: the attention backend's own builder,
    # not the C++ step's wrapper (whose steps carry no Python plan).
    builder = runner.step_builder.attn_builder
    eager_builder = getattr(builder, "inner", builder)
    try:
        out = []
        for seq in seqs:
            t = len(seq)
            nblk = cdiv(t, bs)
            positions = torch.arange(t, device=dev)
            meta = AttentionMetadata(
                num_actual_tokens=t, num_reqs=1, num_decodes=0, max_query_len=t,
                max_seq_len=t, slot_mapping=positions.clone(),
                query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=dev),
                seq_lens=torch.tensor([t], dtype=torch.int32, device=dev),
                block_tables=torch.arange(nblk, dtype=torch.int32, device=dev)[None],
                query_start_loc_cpu=[0, t], seq_lens_cpu=[t])
            eager_builder.build(meta, positions)
            hidden = model(torch.tensor(seq, device=dev), positions, meta)  # [T, H]
            out.append(hidden.float().cpu().clone())  # a normal tensor: autograd reads it
        return out
    finally:
        kvc.bind_kv_cache(model, runner.kv_caches)


def dense_lm_head(llm) -> torch.Tensor:
    """The base model's output projection as a dense float32 [V, H] matrix, whatever its
    storage (read through the layer itself: lm_head(I) = W^T)."""
    model = llm.engine.core.executor.runner.model
    hidden = model.config.hidden_size
    with torch.inference_mode():
        eye = torch.eye(hidden, dtype=next(model.parameters()).dtype
                        if next(model.parameters()).is_floating_point() else torch.float32)
        w = model.compute_logits(eye).t().contiguous().float()  # [V, H]
    return w.clone()  # out of inference mode: the training graph reads it


def make_examples(hidden: list[torch.Tensor], seqs: list[list[int]], starts: list[int],
                  num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs [N, H] (hidden states at answer positions) and targets [N, heads] (the token
    k + 2 places ahead for head k; -100 past the end of the sequence)."""
    xs, ys = [], []
    for h, seq, start in zip(hidden, seqs, starts):
        tok = torch.tensor(seq)
        t = len(seq)
        pos = torch.arange(start - 1, t - 2)  # positions whose next token is an answer token
        if not len(pos):
            continue
        target = torch.full((len(pos), num_heads), -100, dtype=torch.int64)
        for k in range(num_heads):
            ahead = pos + k + 2
            ok = ahead < t
            target[ok, k] = tok[ahead[ok]]
        xs.append(h[pos])
        ys.append(target)
    return torch.cat(xs), torch.cat(ys)


def generate_answers(llm, prompts: list[str], ns: argparse.Namespace
                     ) -> tuple[list[list[int]], list[int]]:
    """The base model's own answers to ``prompts`` (chat template, greedy, plus
    ``samples_per_prompt - 1`` sampled ones each): token sequences (prompt + answer) and
    where each answer starts. With ``--data-cache``: read from it when it exists (and was
    made for the same model, answer length and samples per prompt), generating only the
    prompts it lacks, and written back with them."""
    from kvflow import SamplingParams

    cache = getattr(ns, "data_cache", None)
    samples = getattr(ns, "samples_per_prompt", 1)
    key = {"model": ns.model, "max_tokens": ns.max_tokens, "samples_per_prompt": samples,
           "sample_temperature": getattr(ns, "sample_temperature", None), "seed": ns.seed}
    known: dict[str, list] = {}  # prompt -> its answers' [seq, start] pairs
    if cache and os.path.isfile(cache):  # answers generated by an earlier run
        with open(cache, encoding="utf-8") as f:
            saved = json.load(f)
        if saved.get("key") == key:
            known = saved["answers"]
        elif "key" not in saved and saved.get("model") == ns.model and samples == 1 and \
                len(saved.get("seqs", ())) == len(saved.get("prompts", ())):
            # The earlier layout (one greedy answer per prompt, in prompt order).
            known = {p: [[q, b]] for p, q, b in zip(saved["prompts"], saved["seqs"],
                                                    saved["starts"])}
        else:
            logger.info("--data-cache %s was made with another model or other generation "
                        "settings: generating again", cache)
    todo = list(dict.fromkeys(p for p in prompts if p not in known))
    if todo:
        params = SamplingParams(temperature=0, max_tokens=ns.max_tokens)
        chats = [[{"role": "user", "content": p}] for p in todo]
        runs = [llm.chat(chats, params, use_tqdm=False)]
        # More answers per prompt: sampled from the base itself (its own distribution,
        # seeded), so the heads see more of the text the base writes than greedy ones.
        for s in range(1, samples):
            sp = SamplingParams(temperature=ns.sample_temperature, max_tokens=ns.max_tokens,
                                seed=ns.seed * 1000 + s)
            runs.append(llm.chat(chats, sp, use_tqdm=False))
        for i, p in enumerate(todo):
            known[p] = [[list(r[i].prompt_token_ids) + list(r[i].outputs[0].token_ids),
                         len(r[i].prompt_token_ids)] for r in runs]
        if cache:
            with open(cache, "w", encoding="utf-8") as f:
                json.dump({"key": key, "answers": known}, f)
    # Sample-major, as before: every prompt's greedy answer, then each sampled round.
    seqs = [known[p][s][0] for s in range(samples) for p in prompts]
    starts = [known[p][s][1] for s in range(samples) for p in prompts]
    return seqs, starts


def head_logits(heads, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[N, H] -> [heads, N, V] through the frozen dense lm_head ``w`` [V, H]."""
    return heads.hidden(x) @ w.t()


def evaluate(heads, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor,
             batch: int = 512) -> list[dict]:
    """Each head's top-1 and top-5 accuracy on (x, y)."""
    num = heads.cfg.num_heads
    ranks = 10
    hit1, hit5, count = np.zeros(num), np.zeros(num), np.zeros(num)
    hit_rank = np.zeros((num, ranks))
    with torch.no_grad():
        for i in range(0, len(x), batch):
            logits = head_logits(heads, x[i: i + batch], w)  # [heads, B, V]
            top = logits.topk(ranks, dim=-1).indices  # [heads, B, ranks]
            top5 = top[..., :5]
            yb = y[i: i + batch].t()  # [heads, B]
            valid = yb >= 0
            hit_rank += ((top == yb[..., None]) & valid[..., None]).sum(dim=1).numpy()
            hit1 += ((top5[..., 0] == yb) & valid).sum(dim=1).numpy()
            hit5 += ((top5 == yb[..., None]).any(dim=-1) & valid).sum(dim=1).numpy()
            count += valid.sum(dim=1).numpy()
    return [{"head": k, "top1": float(hit1[k] / max(count[k], 1)),
             "top5": float(hit5[k] / max(count[k], 1)), "tokens": int(count[k]),
             # Probability that the rank-r guess is right: what candidate trees are built
             # from (spec_decode/tree.py).
             "rank_accuracy": [round(float(h / max(count[k], 1)), 5) for h in hit_rank[k]]}
            for k in range(num)]


def train(ns: argparse.Namespace) -> dict:
    from kvflow import LLM
    from kvflow.spec_decode.medusa import MedusaHeads

    start_time = time.perf_counter()
    torch.manual_seed(ns.seed)
    prompts = read_prompts(ns.prompts or default_prompts_path())[: ns.num_prompts]
    llm = LLM(ns.model, device="cpu", max_model_len=ns.max_model_len,
              kv_cache_memory="256MiB", max_num_seqs=32, quantization=ns.quantization)
    seqs, starts = generate_answers(llm, prompts, ns)
    logger.info("generated %d answers (%d tokens) in %.0f s", len(seqs),
                sum(len(s) - b for s, b in zip(seqs, starts)), time.perf_counter() - start_time)
    hidden = last_hidden_states(llm, seqs)
    w = dense_lm_head(llm)  # [V, H]
    arch = llm.engine.core.executor.runner.model.config
    # Held out: every tenth prompt, all its answers out of training (no position or
    # prompt leaks across); evaluated on its greedy answer, the text serving predicts.
    num_p = len(prompts) if len(seqs) % len(prompts) == 0 else len(seqs)
    split = [[i for i in range(len(seqs)) if (i % num_p) % 10 != 0],
             [i for i in range(min(num_p, len(seqs))) if i % 10 == 0]]
    (x_tr, y_tr), (x_ev, y_ev) = (make_examples([hidden[i] for i in idx],
                                                [seqs[i] for i in idx],
                                                [starts[i] for i in idx], ns.num_heads)
                                  for idx in split)
    logger.info("hidden states cached: %d training and %d held-out positions", len(x_tr),
                len(x_ev))
    cfg = MedusaHeadsConfig(num_heads=ns.num_heads, num_layers=1,
                            hidden_size=arch.hidden_size, vocab_size=arch.vocab_size,
                            shared_lm_head=True)
    heads = MedusaHeads(cfg, arch.hidden_size, arch.vocab_size)
    before = evaluate(heads, x_ev, y_ev, w)
    opt = torch.optim.AdamW(heads.parameters(), lr=ns.lr, weight_decay=0.0)
    steps = ns.epochs * math.ceil(len(x_tr) / ns.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=ns.lr, total_steps=steps,
                                                pct_start=0.1)
    for epoch in range(ns.epochs):
        perm = torch.randperm(len(x_tr))
        total, n = 0.0, 0
        for i in range(0, len(x_tr), ns.batch_size):
            idx = perm[i: i + ns.batch_size]
            logits = head_logits(heads, x_tr[idx], w)  # [heads, B, V]
            y = y_tr[idx].t()  # [heads, B]
            # Farther heads are harder and matter less (a draft is only used when all
            # before it are accepted): weight head k by 0.8^k, as Medusa does.
            loss = sum(0.8 ** k * torch.nn.functional.cross_entropy(
                logits[k], y[k], ignore_index=-100) for k in range(ns.num_heads))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach()) * len(idx)
            n += len(idx)
        logger.info("epoch %d: loss %.3f (%.0f s)", epoch + 1, total / max(n, 1),
                    time.perf_counter() - start_time)
    after = evaluate(heads, x_ev, y_ev, w)
    report = {"base_model": ns.model, "prompts": len(prompts), "train_positions": len(x_tr),
              "heldout_positions": len(x_ev), "epochs": ns.epochs,
              "seconds": round(time.perf_counter() - start_time, 1),
              "heldout_before": before, "heldout": after}
    heads.save(ns.output, extra={"kvflow_train_medusa": report})
    for row in after:
        print(f"head {row['head']} (token +{row['head'] + 2}): held-out top-1 "
              f"{row['top1']:.1%}, top-5 {row['top5']:.1%} ({row['tokens']} tokens)")
    print(f"wrote {ns.output} in {report['seconds']:.0f} s")
    return report


__all__ = ["train"]
