"""eagle_mlp draft heads: checkpoint round trip, the drafting loop against a hand-written
reference, startup errors naming the option, greedy output equal to plain greedy through
LLM(...) (exact chain verification), and the training examples' offsets (step j of the
unrolled head reads token t + 1 + j and is scored on token t + 2 + j)."""

from __future__ import annotations

import json

import pytest
import torch

from kvflow import LLM, SamplingParams
from spec_heads import ENGINE_VARIANTS, assert_spec_equals_plain, tiny
from kvflow.engine.args import EngineArgs
from kvflow.errors import InvalidParameterError, ModelLoadError, ModelNotFoundError
from kvflow.spec_decode.eagle_mlp import EagleMlpHead, EagleMlpProposer
from kvflow.spec_decode.heads_config import EagleMlpConfig
from kvflow.train.eagle import make_examples

HIDDEN, VOCAB = 64, 512  # tiny-llama


def write_head(path, hidden=HIDDEN, vocab=VOCAB, draft_vocab=128, seed=0):
    cfg = EagleMlpConfig(hidden_size=hidden, vocab_size=vocab, draft_vocab_size=draft_vocab,
                         intermediate_size=32)
    head = EagleMlpHead(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 and
                                                                  p.shape[0] == hidden else 0))
        head.vocab.copy_(torch.randperm(vocab, generator=g)[:draft_vocab].sort().values)
        # The tiny dummy model's lm_head is small: a large output scale makes the head's
        # probabilities peaked enough for draft_confidence to keep some drafts.
        head.out_norm.weight.mul_(20)
    head.save(str(path))
    return head



def _greedy_draft_probs(prop, hidden, last, k):
    """Reference for the proposer's gate: the head's top probability at each of k greedy
    drafting steps, [R, k]."""
    with torch.no_grad():
        f, tok, probs = hidden, last, []
        for _ in range(k):
            f = prop.head(f, prop.embed(tok))
            p = (f @ prop.lm_rows.t()).softmax(-1)
            probs.append(p.max(-1).values)
            tok = prop.vocab[p.argmax(-1)]
    return torch.stack(probs, 1)

def test_checkpoint_round_trip(tmp_path):
    head = write_head(tmp_path)
    loaded = EagleMlpHead.load(str(tmp_path), torch.float32, torch.device("cpu"))
    f, e = torch.randn(5, HIDDEN), torch.randn(5, HIDDEN)
    torch.testing.assert_close(loaded(f, e), head(f, e))
    assert torch.equal(loaded.vocab, head.vocab)
    assert EagleMlpConfig.read(str(tmp_path)) == head.cfg


def test_drafting_loop_matches_reference(tmp_path):
    """k drafts: each step feeds the head's own feature and its previous draft back in,
    and picks the argmax over the draft vocabulary's rows of the target's lm_head."""
    write_head(tmp_path)
    llm = tiny()
    target = llm.engine.core.executor.runner.model
    prop = EagleMlpProposer(str(tmp_path), 3, target, torch.float32, torch.device("cpu"))
    hidden = torch.randn(2, HIDDEN)
    seqs = [torch.tensor([5, 9, 11]).numpy(), torch.tensor([7]).numpy()]
    got = prop.propose(seqs, [3, 2], hidden=hidden)
    head = EagleMlpHead.load(str(tmp_path), torch.float32, torch.device("cpu"))
    with torch.no_grad():
        logits_w = target.compute_logits(torch.eye(HIDDEN)).t()  # [V, H]
        emb = target.model.embed_tokens(torch.arange(VOCAB))
    for r, (seq, m) in enumerate(zip(seqs, [3, 2])):
        f, tok, want = hidden[r: r + 1], int(seq[-1]), []
        for _ in range(3):
            f = head(f, emb[tok][None])
            scores = f @ logits_w[head.vocab].t()
            tok = int(head.vocab[scores.argmax()])
            want.append(tok)
        assert got[r] == want[:m]
    assert all(t in set(head.vocab.tolist()) for row in got for t in row)


def test_draft_confidence_cuts_drafts_at_the_first_unsure_one(tmp_path):
    """With draft_confidence, a request's drafts end before the first the head gives a
    probability under it (so a sure first draft and an unsure second give one draft)."""
    write_head(tmp_path)
    target = tiny().engine.core.executor.runner.model
    sure = EagleMlpProposer(str(tmp_path), 3, target, torch.float32, torch.device("cpu"))
    hidden = torch.randn(4, HIDDEN)
    last = torch.tensor([5, 9, 11, 7])
    drafts, keep = sure.draft(hidden, last, 3)
    assert keep.tolist() == [3] * 4
    gated = EagleMlpProposer(str(tmp_path), 3, target, torch.float32, torch.device("cpu"),
                             min_confidence=0.3)
    probs = _greedy_draft_probs(gated, hidden, last, 3)  # what the gate reads, step by step
    want = (probs >= 0.3).long().cumprod(1).sum(1)
    got_drafts, got_keep = gated.draft(hidden, last, 3)
    n = got_drafts.shape[1]  # the loop stops once every chain has ended
    assert n == 3 or int(want.max()) < n
    assert torch.equal(got_drafts, drafts[:, :n]) and torch.equal(got_keep, want)
    rows = gated.propose([t.numpy()[None] for t in last], [3] * 4, hidden=hidden)
    assert [len(r) for r in rows] == want.tolist()
    top = float(probs.max())
    never = EagleMlpProposer(str(tmp_path), 3, target, torch.float32, torch.device("cpu"),
                             min_confidence=(1 + top) / 2)
    assert never.propose([t.numpy()[None] for t in last], [3] * 4, hidden=hidden) == [[]] * 4


@ENGINE_VARIANTS
def test_greedy_eagle_mlp_equals_plain_greedy(tmp_path, overrides):
    write_head(tmp_path)
    assert_spec_equals_plain({"method": "eagle_mlp", "model": str(tmp_path),
                              "num_speculative_tokens": 3, "disable_by_batch_size": None,
                              "draft_confidence": 0.2}, overrides)


@pytest.mark.parametrize("kind, error, match", [
    ("hidden", InvalidParameterError, "eagle_mlp head is for hidden size 32 but the target"),
    ("vocab", InvalidParameterError, "eagle_mlp head is for a vocabulary of 1024"),
    ("missing", ModelNotFoundError, "speculative_config.model: .* is not a directory"),
    ("medusa", ModelLoadError, "speculative_config.model: cannot read .* as an eagle_mlp"),
    ("none", InvalidParameterError, "speculative_config.model is needed for method eagle_mlp"),
    ("tree", InvalidParameterError, "medusa_tree is an option of method medusa"),
    ("confidence", InvalidParameterError, "draft_confidence must be a number in"),
    ("ngram", InvalidParameterError, "draft_confidence is an option of method eagle_mlp"),
])
def test_bad_heads_fail_at_startup_naming_the_option(tmp_path, kind, error, match):
    write_head(tmp_path, hidden=32 if kind == "hidden" else HIDDEN,
               vocab=1024 if kind == "vocab" else VOCAB)
    spec = {"method": "eagle_mlp", "model": str(tmp_path), "num_speculative_tokens": 3}
    if kind == "missing":
        spec["model"] = str(tmp_path / "nope")
    if kind == "medusa":  # a Medusa checkpoint's config.json in the directory
        (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 3}))
    if kind == "none":
        del spec["model"]
    if kind == "tree":
        spec["medusa_tree"] = 4
    if kind == "confidence":
        spec["draft_confidence"] = 1.5
    if kind == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 3, "draft_confidence": 0.5}
    args = EngineArgs(model="tiny-llama", load_format="dummy", device="cpu",
                      max_model_len=64, speculative_config=spec)
    with pytest.raises(error, match=match):
        args.create_engine_config()


def test_training_examples_unroll_offsets():
    seq = list(range(100, 110))  # 10 tokens, the answer starts at index 6
    hidden = [torch.arange(10, dtype=torch.float32)[:, None].repeat(1, 4)]  # h_p = p
    vmap = torch.full((200,), -100, dtype=torch.int64)
    vmap[100:109] = torch.arange(9)  # token 109 is outside the draft vocabulary
    f, x, y, t = make_examples(hidden, [seq], [6], 2, vmap)
    # Rows 5..7 (the base gives tokens 6..8 there): step 0 reads token t+1 and is scored
    # on t+2; step 1 reads t+2 (the previous step's true answer), scored on t+3.
    assert f[:, 0].tolist() == [5.0, 6.0, 7.0]
    assert x[:, 0].tolist() == [106, 107, 108]
    assert y[:, 0].tolist() == [7, 8, -100]  # 109 not in the draft vocabulary
    assert x[:2, 1].tolist() == [107, 108] and y[:, 1].tolist() == [8, -100, -100]
    assert t[:, 0, 0].tolist() == [6.0, 7.0, 8.0]  # the true feature step 0 predicts


@pytest.mark.slow
def test_train_eagle_cli_writes_a_head_that_serves(tmp_path, smollm2):
    """kvflow train-eagle end to end at a toy size (10 prompts, 16 tokens, 1 epoch) on
    the embedded model; the checkpoint then drafts for it, greedy output equal to plain
    greedy."""
    from kvflow.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"Name {n} animals that live in the sea." for n in
                                 range(2, 12)) + "\n")
    more = tmp_path / "more.txt"
    more.write_text("Name two birds.\nName two fish.\n")
    evals = tmp_path / "eval.txt"
    evals.write_text("Name three colours.\n")
    out = tmp_path / "head"
    cache = tmp_path / "answers.json"
    assert main(["train-eagle", "--output", str(out), "--prompts", str(prompts), str(more),
                 "--max-tokens", "16", "--epochs", "1", "--unroll", "2",
                 "--draft-vocab-size", "256", "--data-cache", str(cache),
                 "--eval-prompts", str(evals), "--eval-max-tokens", "8"]) == 0
    report = json.loads((out / "config.json").read_text())["kvflow_train_eagle"]
    assert report["prompts"] == 12 and report["heldout_positions"] > 0
    assert set(report["heldout"]["mean_accepted_run"]) == {"1", "2"}
    assert len(json.loads(cache.read_text())["answers"]) == 12
    ev = report["eval_prompts"]
    assert ev["prompts"] == 1 and ev["positions"] == 8 - 2 + 1  # rows 0..6 of 8 tokens
    assert set(ev["confidence_sweep"]) == {"per_draft", "cumulative"}
    assert len(ev["topk_given_previous_right"][0]) == 3
    chat = [{"role": "user", "content": "Name three colours."}]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = smollm2.chat(chat, params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM("smollm2-135m", device="cpu", max_model_len=512, kv_cache_memory="64MiB",
              quantization="none", speculative_config={
                  "method": "eagle_mlp", "model": str(out), "num_speculative_tokens": 2})
    assert llm.chat(chat, params, use_tqdm=False)[0].outputs[0].token_ids == want


def test_cli_generate_with_eagle_mlp_and_bad_config(tmp_path):
    """--speculative-config with eagle_mlp through the command line (the server parses the
    same flag with the same EngineArgs)."""
    import os
    import subprocess
    import sys

    write_head(tmp_path, hidden=576, vocab=49152, draft_vocab=256)  # for the embedded model
    env = {**os.environ, "KVFLOW_NO_PROGRESS": "1"}
    cmd = [sys.executable, "-m", "kvflow.cli", "generate", "--max-model-len", "256",
           "--kv-cache-memory", "32MiB", "--max-tokens", "8", "--prompt", "Name two colours."]
    p = subprocess.run(cmd + ["--speculative-config",
                              '{"method": "eagle_mlp", "num_speculative_tokens": 2}'],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and "model is needed for method eagle_mlp" in p.stderr
    spec = json.dumps({"method": "eagle_mlp", "model": str(tmp_path),
                       "num_speculative_tokens": 2})
    p = subprocess.run(cmd + ["--speculative-config", spec], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip()


def test_confidence_sweep_counts_what_the_gate_would_propose_and_keep():
    """confidence_sweep against a direct count: per rule and threshold, drafts proposed
    (until the gate first fails), kept (leading proposed drafts that are right), and
    head passes (one more than proposed, at most k)."""
    from kvflow.train.eagle import confidence_sweep, unroll_head

    torch.manual_seed(0)
    cfg = EagleMlpConfig(hidden_size=16, vocab_size=40, draft_vocab_size=8,
                         intermediate_size=8)
    head = EagleMlpHead(cfg)
    with torch.no_grad():
        head.out_norm.weight.mul_(3)
    embed, rows = torch.randn(40, 16), torch.randn(8, 16)
    f, x = torch.randn(300, 16), torch.randint(0, 40, (300, 3))
    with torch.no_grad():
        outs = unroll_head(head, embed, f, x)
        p = torch.stack([(o @ rows.t()).softmax(-1) for o in outs], 1)  # [N, 3, 8]
    best, pick = p.max(-1)
    y = torch.where(torch.rand(300, 3) < 0.6, pick, (pick + 1) % 8)  # ~60% right
    got = confidence_sweep(head, embed, rows, f, x, y, (0.0, 0.2, 0.35))
    for rule in ("per_draft", "cumulative"):
        for c in (0.0, 0.2, 0.35):
            proposed, kept, passes = [], [], []
            for i in range(300):
                n, run, chain, alive = 0, 0, 1.0, True
                for j in range(3):
                    chain *= float(best[i, j])
                    score = float(best[i, j]) if rule == "per_draft" else chain
                    if score < c:
                        break
                    n += 1
                    alive = alive and bool(pick[i, j] == y[i, j])
                    run += alive
                proposed.append(n)
                kept.append(run)
                passes.append(min(n + 1, 3))
            row = got[rule][str(c)]
            assert row["proposed"] == pytest.approx(sum(proposed) / 300, abs=1e-4)
            assert row["kept"] == pytest.approx(sum(kept) / 300, abs=1e-4)
            assert row["head_passes"] == pytest.approx(sum(passes) / 300, abs=1e-4)
            assert row["steps_with_drafts"] == pytest.approx(
                sum(n > 0 for n in proposed) / 300, abs=1e-4)
    assert got["per_draft"]["0.0"]["proposed"] == 3.0  # no gate: every draft proposed


def test_answer_cache_generates_only_the_prompts_it_lacks(tmp_path):
    """--data-cache keeps answers per prompt: a second run with more prompts generates
    just the new ones, and a run with another answer length generates all again."""
    import argparse

    from kvflow.train.medusa import generate_answers

    class FakeLLM:
        def __init__(self):
            self.asked = []

        def chat(self, chats, params, use_tqdm=False):
            from types import SimpleNamespace as NS

            outs = []
            for c in chats:
                text = c[0]["content"]
                self.asked.append(text)
                prompt = [len(text), 1]
                outs.append(NS(prompt_token_ids=prompt, outputs=[NS(
                    token_ids=[ord(ch) for ch in text[: params.max_tokens]])]))
            return outs

    cache = str(tmp_path / "answers.json")
    ns = argparse.Namespace(model="m", max_tokens=4, seed=0, data_cache=cache,
                            samples_per_prompt=1, sample_temperature=0.8)
    llm = FakeLLM()
    seqs, starts = generate_answers(llm, ["ab", "cde"], ns)
    assert seqs == [[2, 1, 97, 98], [3, 1, 99, 100, 101]] and starts == [2, 2]
    llm2 = FakeLLM()
    seqs2, _ = generate_answers(llm2, ["cde", "fghij", "ab"], ns)
    assert llm2.asked == ["fghij"]
    assert seqs2 == [seqs[1], [5, 1, 102, 103, 104, 105], seqs[0]]
    ns.max_tokens = 2
    llm3 = FakeLLM()
    generate_answers(llm3, ["ab"], ns)
    assert llm3.asked == ["ab"]


def test_cumulative_confidence_gates_on_the_chain_probability(tmp_path):
    """rule="cumulative": a request's drafts stop before the first whose chain
    probability (the product of the head's probabilities so far) is below the gate."""
    write_head(tmp_path)
    target = tiny().engine.core.executor.runner.model
    prop = EagleMlpProposer(str(tmp_path), 3, target, torch.float32, torch.device("cpu"),
                            min_confidence=0.2, rule="cumulative")
    hidden, last = torch.randn(6, HIDDEN), torch.tensor([5, 9, 11, 7, 3, 2])
    chain = _greedy_draft_probs(prop, hidden, last, 3).cumprod(1)
    want = (chain >= 0.2).long().cumprod(1).sum(1)
    _, keep = prop.draft(hidden, last, 3)
    assert torch.equal(keep, want)
    with pytest.raises(InvalidParameterError, match="confidence rule"):
        EagleMlpProposer(str(tmp_path), 3, target, torch.float32, torch.device("cpu"),
                         rule="sometimes")
