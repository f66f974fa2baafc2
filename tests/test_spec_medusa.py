"""Medusa heads: loading our checkpoints and the public layout, startup errors naming the
option, greedy output equal to plain greedy through LLM(...) (chain verification), and
the training examples' offsets (head k learns the token k + 2 places ahead)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kvflow import LLM, SamplingParams
from spec_heads import ENGINE_VARIANTS, assert_spec_equals_plain
from kvflow.engine.args import EngineArgs
from kvflow.errors import InvalidParameterError, ModelNotFoundError
from kvflow.spec_decode.heads_config import HEADS_FILE, MedusaHeadsConfig
from kvflow.spec_decode.medusa import MedusaHeads
from kvflow.train.medusa import make_examples

HIDDEN, VOCAB = 64, 512  # tiny-llama


def write_heads(path, num_heads=3, shared=True, hidden=HIDDEN, seed=0):
    cfg = MedusaHeadsConfig(num_heads=num_heads, num_layers=1, hidden_size=hidden,
                            vocab_size=VOCAB, shared_lm_head=shared)
    heads = MedusaHeads(cfg, hidden, VOCAB)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    heads.save(str(path))
    return heads


def test_checkpoint_round_trip(tmp_path):
    heads = write_heads(tmp_path)
    loaded = MedusaHeads.load(str(tmp_path), HIDDEN, VOCAB, torch.float32, torch.device("cpu"))
    x = torch.randn(5, HIDDEN)
    base = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    torch.testing.assert_close(loaded.logits(x, base), heads.logits(x, base).float())


def test_public_medusa_layout_loads(tmp_path):
    """The public repositories' files: their own projection per head, names
    ``{i}.{j}.linear.*`` / ``{i}.{num_layers}.weight`` (optionally prefixed), and a
    config.json with only medusa_num_heads / medusa_num_layers."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    tensors = {}
    for i in range(2):
        tensors[f"medusa_head.{i}.0.linear.weight"] = torch.randn(HIDDEN, HIDDEN, generator=g)
        tensors[f"medusa_head.{i}.0.linear.bias"] = torch.randn(HIDDEN, generator=g)
        tensors[f"medusa_head.{i}.1.weight"] = torch.randn(VOCAB, HIDDEN, generator=g)
    save_file(tensors, os.path.join(tmp_path, HEADS_FILE))
    (tmp_path / "config.json").write_text(json.dumps(
        {"medusa_num_heads": 2, "medusa_num_layers": 1, "base_model_name_or_path": "x"}))
    heads = MedusaHeads.load(str(tmp_path), HIDDEN, VOCAB, torch.float32, torch.device("cpu"))
    x = torch.randn(3, HIDDEN)
    w1, b1 = tensors["medusa_head.1.0.linear.weight"], tensors["medusa_head.1.0.linear.bias"]
    h = x + torch.nn.functional.silu(x @ w1.t() + b1)
    want = h @ tensors["medusa_head.1.1.weight"].t()
    torch.testing.assert_close(heads.logits(x, None)[1], want, rtol=1e-4, atol=1e-4)


@ENGINE_VARIANTS
def test_greedy_medusa_equals_plain_greedy(tmp_path, overrides):
    write_heads(tmp_path)
    assert_spec_equals_plain({"method": "medusa", "model": str(tmp_path),
                              "num_speculative_tokens": 3,
                              "disable_by_batch_size": None}, overrides)


@pytest.mark.parametrize("kind, error, match", [
    ("hidden", InvalidParameterError, "heads are for hidden size 32 but the target's is 64"),
    ("k", InvalidParameterError, "num_speculative_tokens is 4 but the Medusa checkpoint has 3"),
    ("missing", ModelNotFoundError, "speculative_config.model: .* is not a directory"),
    ("none", InvalidParameterError, "speculative_config.model is needed for method medusa"),
])
def test_bad_heads_fail_at_startup_naming_the_option(tmp_path, kind, error, match):
    write_heads(tmp_path, hidden=32 if kind == "hidden" else HIDDEN)
    spec = {"method": "medusa", "model": str(tmp_path), "num_speculative_tokens": 3}
    if kind == "k":
        spec["num_speculative_tokens"] = 4
    if kind == "missing":
        spec["model"] = str(tmp_path / "nope")
    if kind == "none":
        del spec["model"]
    args = EngineArgs(model="tiny-llama", load_format="dummy", device="cpu",
                      max_model_len=64, speculative_config=spec)
    with pytest.raises(error, match=match):
        args.create_engine_config()


def test_training_examples_look_k_plus_2_ahead():
    seq = list(range(100, 110))  # 10 tokens, the answer starts at index 6
    hidden = [torch.arange(10, dtype=torch.float32)[:, None].repeat(1, 4)]  # h_p = p
    x, y = make_examples(hidden, [seq], [6], num_heads=2)
    # Positions 5..7: the base predicts 6..8, head 0 tokens 7..9, head 1 tokens 8, 9, -.
    assert x[:, 0].tolist() == [5.0, 6.0, 7.0]
    assert y[:, 0].tolist() == [107, 108, 109]
    assert y[:, 1].tolist() == [108, 109, -100]


@pytest.mark.slow
def test_train_medusa_cli_writes_heads_medusa_loads(tmp_path, smollm2):
    """kvflow train-medusa end to end at a toy size (10 prompts, 12 tokens, 1 epoch) on
    the embedded model; the checkpoint then serves as medusa heads, greedy output equal
    to plain greedy."""
    from kvflow.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"Name {n} animals that live in the sea." for n in
                                 range(2, 12)) + "\n")
    out = tmp_path / "heads"
    assert main(["train-medusa", "--output", str(out), "--prompts", str(prompts),
                 "--max-tokens", "12", "--epochs", "1", "--num-heads", "2"]) == 0
    report = json.loads((out / "config.json").read_text())["kvflow_train_medusa"]
    assert report["prompts"] == 10 and report["heldout_positions"] > 0
    assert [h["head"] for h in report["heldout"]] == [0, 1]
    chat = [{"role": "user", "content": "Name three colours."}]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = smollm2.chat(chat, params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM("smollm2-135m", device="cpu", max_model_len=512, kv_cache_memory="64MiB",
              quantization="none", speculative_config={
                  "method": "medusa", "model": str(out), "num_speculative_tokens": 2})
    assert llm.chat(chat, params, use_tqdm=False)[0].outputs[0].token_ids == want
