"""Tensor parallelism with quantized weights (CPU, gloo): int8 and int4 quantized at
load, and GGUF blocks kept quantized, split over the ranks along their output, input and
vocabulary dimensions, give TP 1's greedy tokens with the same quantization; a split
that would cut a quantization group or block is refused."""

from __future__ import annotations

import os

import pytest
from prequant_checkpoints import _write_prequantized
from tiny_gguf import write_tiny_gguf

from kvflow import LLM
from kvflow.errors import ModelLoadError
from kvflow.sampling_params import SamplingParams

PROMPTS = [[1, 5, 7, 9, 11, 13], [3, 4, 5], list(range(20, 60))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)


def engine(model: str, quantization: str, **kw) -> LLM:
    if not os.path.exists(model):  # an architecture preset: random weights
        kw.setdefault("load_format", "dummy")
    return LLM(model, quantization=quantization, device="cpu", max_model_len=256,
               num_gpu_blocks_override=64, skip_tokenizer_init=True, seed=3,
               distributed_timeout=30, **kw)


def run(llm: LLM):
    return [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def assert_greedy_same(ref, got) -> None:
    """Token for token, except that after a near-tie (TP 1's top two within bfloat16's
    resolution of the logits) the sequences may part: the packed ops round activations
    and logits to bfloat16, and the ranks sum their partial products in another order."""
    for r, g in zip(ref, got):
        for i, (rt, gt) in enumerate(zip(r.token_ids, g.token_ids)):
            lr, lg = r.logprobs[i], g.logprobs[i]
            assert lg[gt].logprob == pytest.approx(lr[rt].logprob, abs=3e-2)
            if rt != gt:
                assert gt in lr and lr[rt].logprob - lr[gt].logprob < 3e-2, (i, lr, lg)
                break  # a tie broken the other way: the rest follows another prefix


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(str(tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


def weights_of_rank0(llm: LLM) -> int:
    return llm.engine.core.executor.runner.weight_bytes


@pytest.mark.parametrize("model,quantization", [
    ("tiny-llama", "int8"), ("tiny-llama", "int4"), ("tiny-qwen2", "int8")])
def test_tp2_quantized_at_load_equals_tp1(model, quantization):
    with engine(model, quantization) as one:
        ref, full = run(one), weights_of_rank0(one)
    with engine(model, quantization, tensor_parallel_size=2) as two:
        assert_greedy_same(ref, run(two))
        qkv = two.engine.core.executor.runner.model.model.layers[0].self_attn.qkv_proj
        assert hasattr(qkv, "qweight") and not hasattr(qkv, "weight")
        assert weights_of_rank0(two) < 0.7 * full  # each rank holds its shard only


def test_tp2_gguf_blocks_equal_tp1(tiny_gguf):
    """Mixed block types in merged layers, a dense (F32) shard, an untied Q4_0 head and
    a Q8_0 table, all cut along their rows, block columns or vocabulary. Both eager: at
    TP 1 the C++ step would run its int8-activation GEMV (TP ranks take the packed bf16
    ops), and this compares the sharding, not the two GEMVs."""
    with engine(tiny_gguf, "gguf", enforce_eager=True) as one:
        ref, full = run(one), weights_of_rank0(one)
    with engine(tiny_gguf, "gguf", tensor_parallel_size=2, enforce_eager=True) as two:
        assert_greedy_same(ref, run(two))
        model = two.engine.core.executor.runner.model
        assert hasattr(model.model.layers[0].mlp.down_proj, "qweight")
        assert hasattr(model.model.embed_tokens, "qvalues")  # the table stays in blocks
        assert weights_of_rank0(two) < 0.7 * full


def test_split_that_cuts_a_gguf_block_is_refused(tiny_gguf):
    # o_proj has 64 inputs: 16 per rank over 4 ranks, half a 32-element Q4_0 block.
    with pytest.raises(ModelLoadError, match="whole number of the checkpoint's 32-element"):
        engine(tiny_gguf, "gguf", tensor_parallel_size=4)


def test_split_that_cuts_an_int4_group_is_refused():
    with pytest.raises(ModelLoadError, match="not a whole number of int4 groups of 32"):
        engine("tiny-llama", "int4", tensor_parallel_size=4)


@pytest.mark.slow
def test_smollm2_gguf_tp3_equals_tp1():
    """The embedded model in its own Q4_1/Q8_0 blocks (tied embedding and head) over 3
    ranks: 9 heads, 3 KV heads, 576 and 1536 inputs in whole blocks per rank. Both runs
    eager: at TP 1 the C++ decode step would otherwise run (int8 activations), which TP
    ranks do not, and the comparison is of the sharding, not of the two GEMVs."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    got = []
    for tp in (1, 3):
        with LLM("smollm2-135m", device="cpu", max_model_len=256, num_gpu_blocks_override=32,
                 tensor_parallel_size=tp, enforce_eager=True) as llm:
            assert llm.engine.core.executor.runner.model.quant_config.method == "gguf"
            got.append([o.outputs[0].token_ids
                        for o in llm.generate(prompts, params, use_tqdm=False)])
    assert got[1] == got[0]


def test_activation_order_gptq_under_tensor_parallelism_is_refused_saying_why(tmp_path):
    _write_prequantized(tmp_path, "gptq", 4, 16, True)
    with pytest.raises(ModelLoadError, match="activation order.*tensor_parallel_size=1"):
        engine(str(tmp_path), "auto", tensor_parallel_size=2)


@pytest.mark.parametrize("fmt", ["gptq", "awq", "compressed-tensors"])
def test_tp2_prequantized_checkpoint_equals_tp1(tmp_path, fmt):
    """Packed int32 words along the input (GPTQ) or output (AWQ, zero points), per-group
    scales, GPTQ's g_idx and compressed-tensors' weight_shape, cut per rank."""
    _write_prequantized(tmp_path, fmt, 4, 32, False)
    with engine(str(tmp_path), "auto") as one:
        ref = run(one)
    with engine(str(tmp_path), "auto", tensor_parallel_size=2) as two:
        assert two.engine.core.executor.runner.model.quant_config.method == fmt
        assert_greedy_same(ref, run(two))
