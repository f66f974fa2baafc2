"""Mixture of experts over two gloo ranks on CPU: tensor parallelism of the experts (each
rank a slice of every expert) and expert parallelism (each rank half of the experts
whole, combined by an all-reduce) give one rank's tokens and logprobs."""

from __future__ import annotations

import pytest

from kvflow.errors import InvalidParameterError

from test_distributed import assert_same, run, tiny


def test_moe_tp2_and_ep2_equal_one_rank():
    # Qwen2-MoE: routed experts, the gated shared expert, a dense (mlp_only) layer
    with tiny("tiny-qwen2-moe") as one:
        ref = run(one)
    with tiny("tiny-qwen2-moe", tensor_parallel_size=2) as tp:
        assert_same(ref, run(tp))
        moe = experts(tp)
        assert (moe.num_local_experts, moe.local_intermediate) == (8, 16)
    with tiny("tiny-qwen2-moe", tensor_parallel_size=2, enable_expert_parallel=True) as ep:
        assert_same(ref, run(ep))
        moe = experts(ep)
        assert (moe.num_local_experts, moe.local_intermediate) == (4, 32)


def experts(llm):
    """Rank 0's experts layer of decoder layer 1."""
    return llm.engine.core.executor.runner.model.model.layers[1].mlp.experts


def test_expert_parallel_needs_experts():
    with pytest.raises(InvalidParameterError, match="enable_expert_parallel"):
        tiny("tiny-llama", enable_expert_parallel=True)
