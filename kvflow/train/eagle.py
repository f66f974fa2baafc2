"""``kvflow train-eagle``: an ``eagle_mlp`` draft head (spec_decode/eagle_mlp.py) for a
frozen base model, by self-distillation.

1. The base model answers a list of prompts (greedy, chat template): the text it writes
   itself, which is what the head must predict when serving (the same generation as
   ``kvflow train-medusa``, shared through ``--data-cache``).
2. One forward of the base over each prompt + answer gives the final hidden states f_t;
   they are cached, so each epoch costs only the head.
3. Training unrolls the head ``--unroll`` steps as serving runs it: step j takes the
   head's own previous output (f_t itself for j = 0) and the true token x_{t+1+j}, and is
   scored on x_{t+2+j} (cross-entropy over the draft vocabulary; weight 0.8^j, since a
   draft only counts when every draft before it was kept) and, lightly, on how close its
   feature is to the true f_{t+1+j}. Training on its own outputs, not on the true
   features, is what makes step 2 and 3 drafts usable.
4. Every tenth prompt is held out. The report gives each draft position's top-1 on it
   (given the earlier drafts were right, which is when it is verified) and the mean run
   of kept drafts per verification step at k = 1..unroll: the figure that sets the
   speed-up (tokens per step = 1 + run).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch.nn import functional as F

from kvflow.logger import init_logger
from kvflow.spec_decode.heads_config import EagleMlpConfig

logger = init_logger(__name__)


def default_prompts_path() -> str:
    from importlib import resources

    return str(resources.files("kvflow.train") / "data" / "draft_prompts.txt")


def make_examples(hidden: list[torch.Tensor], seqs: list[list[int]], starts: list[int],
                  unroll: int, vmap: torch.Tensor):
    """Per answer position t: f_t [N, H], tokens x_{t+1+j} [N, U], draft-vocabulary labels
    of x_{t+2+j} [N, U] (-100: past the end, or not in the draft vocabulary) and the true
    features f_{t+1+j} [N, U, H]."""
    fs, xs, ys, ts = [], [], [], []
    for h, seq, start in zip(hidden, seqs, starts):
        tok, t = torch.tensor(seq), len(seq)
        pos = torch.arange(start - 1, t - 2)  # rows whose next token is an answer token
        if not len(pos):
            continue
        n = len(pos)
        x = torch.zeros(n, unroll, dtype=torch.int64)
        y = torch.full((n, unroll), -100, dtype=torch.int64)
        feat = torch.zeros(n, unroll, h.shape[1], dtype=h.dtype)
        for j in range(unroll):
            ok = pos + 2 + j < t
            x[ok, j] = tok[pos[ok] + 1 + j]
            y[ok, j] = vmap[tok[pos[ok] + 2 + j]]
            feat[ok, j] = h[pos[ok] + 1 + j]
        fs.append(h[pos])
        xs.append(x)
        ys.append(y)
        ts.append(feat)
    return torch.cat(fs), torch.cat(xs), torch.cat(ys), torch.cat(ts)


def unroll_head(head, embed: torch.Tensor, f: torch.Tensor, x: torch.Tensor
                ) -> list[torch.Tensor]:
    """The head run ``x.shape[1]`` steps from features f [N, H] with true tokens x [N, U]
    (each step fed the previous step's output): features [N, H] per step."""
    out = []
    for j in range(x.shape[1]):
        f = head(f, embed[x[:, j]])
        out.append(f)
    return out


def evaluate(head, embed, lm_rows, f, x, y, batch: int = 2048) -> dict:
    """Held-out top-1 per draft position (among positions whose earlier drafts were all
    right) and the mean run of kept drafts with k = 1..U drafts a step."""
    u = x.shape[1]
    ranks = 3
    runs = torch.zeros(u)
    right = torch.zeros(u)
    right_k = torch.zeros(u, ranks)  # the answer among the head's top r + 1
    tried = torch.zeros(u)
    with torch.no_grad():
        for i in range(0, len(f), batch):
            outs = unroll_head(head, embed, f[i: i + batch], x[i: i + batch])
            tops = torch.stack([(o @ lm_rows.t()).topk(ranks, dim=-1).indices
                                for o in outs], dim=1)  # [B, U, ranks]
            among = (tops == y[i: i + batch, :, None]).long().cumsum(dim=-1)  # [B, U, r]
            hits = among[..., 0].bool()  # [B, U]: the top-1 draft is right
            alive = hits.long().cumprod(dim=1)  # [B, U]: drafts 0..j all right
            before = torch.cat([torch.ones(len(hits), 1, dtype=torch.long), alive[:, :-1]], 1)
            right += (hits & before.bool()).sum(0).float()
            right_k += (among * before[..., None]).sum(0).float()
            tried += before.sum(0).float()
            runs += alive.cumsum(dim=1).sum(0).float()  # run length at k = 1..U
    n = max(len(f), 1)
    return {"top1_given_previous_right": [round(float(r / max(t, 1)), 4)
                                          for r, t in zip(right, tried)],
            # What a tree of the head's top-r guesses at a position could keep there.
            "topk_given_previous_right": [[round(float(a / max(t, 1)), 4) for a in row]
                                          for row, t in zip(right_k, tried)],
            "mean_accepted_run": {str(k + 1): round(float(runs[k] / n), 4) for k in range(u)},
            "positions": len(f)}


def confidence_sweep(head, embed, lm_rows, f, x, y, thresholds, batch: int = 2048
                     ) -> dict:
    """What ``draft_confidence`` would do on (f, x, y), with k = U drafts a step and both
    gating rules: ``per_draft`` stops before the first draft whose own probability under
    the head is below c, ``cumulative`` before the first whose chain probability (the
    product of the probabilities up to it, the head's estimate that it is kept) is. Per
    rule and c: mean drafts proposed and kept per step, the share of steps that propose
    any, and the head passes per step (the proposer stops once its chain has ended)."""
    u = x.shape[1]
    probs, hits = [], []
    with torch.no_grad():
        for i in range(0, len(f), batch):
            outs = unroll_head(head, embed, f[i: i + batch], x[i: i + batch])
            ps, hs = [], []
            for j, o in enumerate(outs):
                best, pick = (o @ lm_rows.t()).softmax(dim=-1).max(dim=-1)
                ps.append(best)
                hs.append(pick == y[i: i + batch, j])
            probs.append(torch.stack(ps, 1))
            hits.append(torch.stack(hs, 1))
    if not probs:
        return {}
    p, hit = torch.cat(probs), torch.cat(hits)  # [N, U] each
    out = {}
    for rule, score in (("per_draft", p), ("cumulative", p.cumprod(dim=1))):
        rows = {}
        for c in thresholds:
            sure = (score >= c).long().cumprod(dim=1)  # [N, U]: draft j proposed
            proposed = sure.sum(1).float()
            kept = (sure * hit.long()).cumprod(dim=1).sum(1).float()
            passes = torch.clamp(proposed + 1, max=u)
            rows[str(c)] = {"proposed": round(float(proposed.mean()), 4),
                            "kept": round(float(kept.mean()), 4),
                            "steps_with_drafts": round(float((proposed > 0).float().mean()),
                                                       4),
                            "head_passes": round(float(passes.mean()), 4)}
        out[rule] = rows
    return out


def eval_answers(llm, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Greedy answers to ``prompts`` as ``kvflow bench --dataset chat`` decodes them
    (chat template, exactly ``max_tokens`` tokens: EOS ignored)."""
    from kvflow import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                    use_tqdm=False)
    return ([list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs],
            [len(o.prompt_token_ids) for o in outs])


def eval_prompts(value: str | None) -> list[str]:
    """``--eval-prompts``: ``bench-chat`` (the prompts of ``kvflow bench --dataset chat``,
    never trained on), ``none``, or a prompt file."""
    if not value or value == "none":
        return []
    if value == "bench-chat":
        from kvflow.bench.datasets import CHAT_PROMPTS

        return list(CHAT_PROMPTS)
    from kvflow.train.medusa import read_prompts

    return read_prompts(value)


SWEEP_THRESHOLDS = (0.0, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


def evaluate_on_prompts(llm, head, embed, lm_rows, vmap, prompts: list[str],
                        max_tokens: int, unroll: int) -> dict:
    """The head on the greedy, EOS-ignoring answers to ``prompts`` (the benchmark's
    workload): per-position top-1, mean kept run and the draft_confidence sweep."""
    seqs, starts = eval_answers(llm, prompts, max_tokens)
    hidden = cached_hidden_states(llm, seqs, None)
    f, x, y, _ = make_examples(hidden, seqs, starts, unroll, vmap)
    f = f.float()
    out = evaluate(head, embed, lm_rows, f, x, y)
    out["draft_vocab_coverage"] = round(float((y[:, 0] >= 0).float().mean()), 4)
    out["confidence_sweep"] = confidence_sweep(head, embed, lm_rows, f, x, y,
                                               SWEEP_THRESHOLDS)
    return out


def print_eval(name: str, result: dict) -> None:
    for j, acc in enumerate(result["top1_given_previous_right"]):
        print(f"{name}: draft {j + 1} (token +{j + 2}): top-1 {acc:.1%} given drafts "
              f"before it right")
    print(f"{name}: mean kept drafts per verification step: " + ", ".join(
        f"k={k}: {v:.2f}" for k, v in result["mean_accepted_run"].items()))
    for rule, rows in result.get("confidence_sweep", {}).items():
        print(f"{name}: draft_confidence ({rule}) at k={len(result['mean_accepted_run'])}: "
              + "; ".join(f"{c}: {r['kept']:.2f} kept / {r['proposed']:.2f} proposed"
                          for c, r in rows.items()))


def cached_hidden_states(llm, seqs: list[list[int]], path: str | None
                         ) -> list[torch.Tensor]:
    """The base's final hidden states over each sequence ([T, H] bfloat16 each: half the
    memory, and the head trains in float32 on them). With ``path``: the sequences it
    holds are read from it, the others computed, and the file written back with them,
    so a retrain with other head settings or more prompts skips most of the base's
    forward too."""
    import os

    from kvflow.train.medusa import last_hidden_states

    known: dict[tuple, torch.Tensor] = {}
    if path and os.path.isfile(path):
        saved = torch.load(path)
        known = {tuple(s): h for s, h in zip(saved.get("seqs", []), saved.get("hidden", []))}
    todo = [s for s in dict.fromkeys(tuple(s) for s in seqs) if s not in known]
    if todo:
        for s, h in zip(todo, last_hidden_states(llm, [list(s) for s in todo])):
            known[s] = h.to(torch.bfloat16)
        if path:
            torch.save({"seqs": [list(s) for s in known], "hidden": list(known.values())},
                       path)
    return [known[tuple(s)] for s in seqs]


def train(ns: argparse.Namespace) -> dict:
    from kvflow import LLM
    from kvflow.spec_decode.eagle_mlp import EagleMlpHead, target_lm_head_rows
    from kvflow.train.medusa import generate_answers, read_prompts

    from kvflow.errors import InvalidParameterError

    for name in ("unroll", "draft_vocab_size", "intermediate_size", "epochs", "batch_size"):
        if getattr(ns, name) < 1:
            raise InvalidParameterError(f"--{name.replace('_', '-')} must be >= 1, got "
                                        f"{getattr(ns, name)}", param=name)
    start_time = time.perf_counter()
    torch.manual_seed(ns.seed)
    files = ns.prompts or [default_prompts_path()]
    prompts = [p for path in ([files] if isinstance(files, str) else files)
               for p in read_prompts(path)][: ns.num_prompts]
    llm = LLM(ns.model, device="cpu", max_model_len=ns.max_model_len,
              kv_cache_memory="1GiB", max_num_seqs=48, quantization=ns.quantization)
    if getattr(ns, "eval_head", None):
        return evaluate_saved_head(llm, ns)
    seqs, starts = generate_answers(llm, prompts, ns)
    gen_s = time.perf_counter() - start_time
    logger.info("generated %d answers (%d tokens) in %.0f s", len(seqs),
                sum(len(s) - b for s, b in zip(seqs, starts)), gen_s)
    hidden = cached_hidden_states(llm, seqs, getattr(ns, "hidden_cache", None))
    model = llm.engine.core.executor.runner.model
    arch = model.config
    with torch.inference_mode():
        embed = model.model.embed_tokens(torch.arange(arch.vocab_size)).float().clone()
    num_p = len(prompts) if len(seqs) % len(prompts) == 0 else len(seqs)
    train_idx = [i for i in range(len(seqs)) if (i % num_p) % 10 != 0]
    heldout_idx = [i for i in range(min(num_p, len(seqs))) if i % 10 == 0]  # greedy answers
    # The draft vocabulary: the most frequent tokens of the training answers.
    counts = torch.zeros(arch.vocab_size)
    for i in train_idx:
        counts += torch.bincount(torch.tensor(seqs[i][starts[i]:]),
                                 minlength=arch.vocab_size).float()
    vd = min(ns.draft_vocab_size, arch.vocab_size)
    vocab = counts.argsort(descending=True)[:vd].sort().values
    vmap = torch.full((arch.vocab_size,), -100, dtype=torch.int64)
    vmap[vocab] = torch.arange(vd)
    lm_rows = target_lm_head_rows(model, vocab).float().clone()  # [Vd, H], frozen
    (f_tr, x_tr, y_tr, t_tr), (f_ev, x_ev, y_ev, _) = (
        make_examples([hidden[i] for i in idx], [seqs[i] for i in idx],
                      [starts[i] for i in idx], ns.unroll, vmap)
        for idx in (train_idx, heldout_idx))
    coverage = float((y_ev[:, 0] >= 0).float().mean()) if len(y_ev) else 0.0
    logger.info("hidden states cached: %d training and %d held-out positions; the draft "
                "vocabulary of %d tokens covers %.1f%% of held-out tokens", len(f_tr),
                len(f_ev), vd, 100 * coverage)
    cfg = EagleMlpConfig(hidden_size=arch.hidden_size, vocab_size=arch.vocab_size,
                         draft_vocab_size=vd, intermediate_size=ns.intermediate_size)
    head = EagleMlpHead(cfg)
    head.vocab.copy_(vocab)
    opt = torch.optim.AdamW(head.parameters(), lr=ns.lr, weight_decay=0.0)
    steps = max(ns.epochs * math.ceil(len(f_tr) / ns.batch_size), 1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=ns.lr, total_steps=steps,
                                                pct_start=0.05)
    for epoch in range(ns.epochs):
        perm = torch.randperm(len(f_tr))
        total = 0.0
        for i in range(0, len(f_tr), ns.batch_size):
            idx = perm[i: i + ns.batch_size]
            outs = unroll_head(head, embed, f_tr[idx].float(), x_tr[idx])
            loss = 0.0
            for j, o in enumerate(outs):
                loss = loss + 0.8 ** j * (
                    F.cross_entropy(o @ lm_rows.t(), y_tr[idx, j], ignore_index=-100)
                    + ns.feature_weight * F.smooth_l1_loss(o, t_tr[idx, j].float()))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach()) * len(idx)
        logger.info("epoch %d: loss %.3f (%.0f s)", epoch + 1, total / max(len(f_tr), 1),
                    time.perf_counter() - start_time)
    result = evaluate(head, embed, lm_rows, f_ev.float(), x_ev, y_ev)
    result["confidence_sweep"] = confidence_sweep(head, embed, lm_rows, f_ev.float(), x_ev,
                                                  y_ev, SWEEP_THRESHOLDS)
    extra = eval_prompts(getattr(ns, "eval_prompts", None))
    bench = evaluate_on_prompts(llm, head, embed, lm_rows, vmap, extra,
                                ns.eval_max_tokens, ns.unroll) if extra else None
    report = {"base_model": ns.model, "prompts": len(prompts), "answers": len(seqs),
              "train_positions": len(f_tr), "heldout_positions": len(f_ev),
              "epochs": ns.epochs, "unroll": ns.unroll, "draft_vocab_coverage": round(coverage, 4),
              "generate_seconds": round(gen_s, 1),
              "seconds": round(time.perf_counter() - start_time, 1), "heldout": result}
    if bench is not None:
        report["eval_prompts"] = {"source": ns.eval_prompts, "prompts": len(extra),
                                  "max_tokens": ns.eval_max_tokens, **bench}
    head.save(ns.output, extra={"kvflow_train_eagle": report})
    print_eval("held-out", result)
    if bench is not None:
        print_eval(ns.eval_prompts, bench)
    print(f"wrote {ns.output} in {report['seconds']:.0f} s")
    return report


def evaluate_saved_head(llm, ns: argparse.Namespace) -> dict:
    """``--eval-head DIR``: no training; the saved head on ``--eval-prompts``' answers."""
    from kvflow.spec_decode.eagle_mlp import EagleMlpHead, target_lm_head_rows

    model = llm.engine.core.executor.runner.model
    arch = model.config
    head = EagleMlpHead.load(ns.eval_head, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        embed = model.model.embed_tokens(torch.arange(arch.vocab_size)).float().clone()
    vocab = head.vocab
    vmap = torch.full((arch.vocab_size,), -100, dtype=torch.int64)
    vmap[vocab] = torch.arange(len(vocab))
    lm_rows = target_lm_head_rows(model, vocab).float().clone()
    prompts = eval_prompts(ns.eval_prompts or "bench-chat")
    result = evaluate_on_prompts(llm, head, embed, lm_rows, vmap, prompts,
                                 ns.eval_max_tokens, ns.unroll)
    print_eval(ns.eval_prompts or "bench-chat", result)
    return result


__all__ = ["confidence_sweep", "evaluate_on_prompts", "train"]
