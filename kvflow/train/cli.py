"""The ``kvflow train-medusa`` command line (torch-free: the CLI builds every parser at
start; the training itself is kvflow/train/medusa.py)."""

from __future__ import annotations

import argparse


def _run(ns: argparse.Namespace) -> int:
    from kvflow.train.medusa import train

    train(ns)
    return 0


def add_train_medusa_parser(sub) -> None:
    p = sub.add_parser("train-medusa", help="train Medusa heads for a frozen base model by "
                       "self-distillation (CPU)")
    p.add_argument("--model", default="smollm2-135m", help="the base model")
    p.add_argument("--output", required=True, help="directory for the heads checkpoint")
    p.add_argument("--prompts", default=None, help="prompt file, one per line (default: "
                   "200 instructions shipped with kvflow)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=96, help="answer length per prompt")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--num-heads", type=int, default=3)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples-per-prompt", type=int, default=1, help="answers per prompt: "
                   "the greedy one plus N - 1 sampled ones (more training text)")
    p.add_argument("--sample-temperature", type=float, default=0.8,
                   help="temperature of the extra sampled answers")
    p.add_argument("--data-cache", default=None, help="JSON file of the generated answers: "
                   "written by the first run, read (skipping generation) by later ones")
    p.add_argument("--quantization", default="auto", help="the base model's weights while "
                   "training (auto: as served)")
    p.set_defaults(func=_run)


def _run_eagle(ns: argparse.Namespace) -> int:
    from kvflow.train.eagle import train

    train(ns)
    return 0


def add_train_eagle_parser(sub) -> None:
    p = sub.add_parser("train-eagle", help="train an eagle_mlp draft head (next hidden state "
                       "from the last one and the emitted token) for a frozen base model by "
                       "self-distillation (CPU)")
    p.add_argument("--model", default="smollm2-135m", help="the base model")
    p.add_argument("--output", required=True, help="directory for the head's checkpoint")
    p.add_argument("--prompts", default=None, nargs="+", help="prompt files, one prompt "
                   "per line, read in order (default: 900 varied instructions shipped with "
                   "kvflow; kvflow/train/data/chat_prompts.txt has 192 chat requests)")
    p.add_argument("--num-prompts", type=int, default=1200, help="at most this many of "
                   "them (every tenth is held out)")
    p.add_argument("--max-tokens", type=int, default=128, help="answer length per prompt")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--unroll", type=int, default=2, help="draft steps trained on the head's "
                   "own outputs (the k it is trained for; later drafts reuse the same block)")
    p.add_argument("--draft-vocab-size", type=int, default=4096, help="tokens the head can "
                   "propose (the most frequent answer tokens): its lm_head cost")
    p.add_argument("--intermediate-size", type=int, default=768)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--feature-weight", type=float, default=0.1, help="weight of the "
                   "feature-regression loss beside the token cross-entropy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples-per-prompt", type=int, default=1, help="answers per prompt: "
                   "the greedy one plus N - 1 sampled ones")
    p.add_argument("--sample-temperature", type=float, default=0.8)
    p.add_argument("--data-cache", default=None, help="JSON file of the generated answers: "
                   "written by the first run, read (skipping generation) by later ones")
    p.add_argument("--hidden-cache", default=None, help="file of the base's hidden states "
                   "over those answers (torch): written by the first run, read (skipping "
                   "the base's forward) by later ones")
    p.add_argument("--quantization", default="auto", help="the base model's weights while "
                   "training (auto: as served)")
    p.add_argument("--eval-prompts", default="bench-chat", help="also report the head on "
                   "the greedy answers to these prompts, decoded as kvflow bench does (EOS "
                   "ignored): bench-chat (the prompts of --dataset chat, never trained on), "
                   "a prompt file, or none")
    p.add_argument("--eval-max-tokens", type=int, default=64, help="answer length of the "
                   "--eval-prompts answers")
    p.add_argument("--eval-head", default=None, help="train nothing: report this saved "
                   "head on --eval-prompts (--unroll drafts deep)")
    p.set_defaults(func=_run_eagle)
