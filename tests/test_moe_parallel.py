"""Mixture of experts over two gloo ranks on CPU: expert parallelism (each rank half of
the experts whole, combined by an all-reduce) and tensor parallelism of the experts
(each rank a slice of every expert) give one rank's tokens and logprobs."""

from __future__ import annotations

import pytest

from kvflow.errors import InvalidParameterError

from test_distributed import assert_same, run, tiny

# Qwen2-MoE: routed experts, the gated shared expert, a dense (mlp_only) layer
MODEL = "tiny-qwen2-moe"


def experts(llm):
    """Rank 0's experts layer of decoder layer 1."""
    return llm.engine.core.executor.runner.model.model.layers[1].mlp.experts


@pytest.fixture(scope="module")
def one_rank():
    with tiny(MODEL) as one:
        return run(one)


def test_ep2_equals_one_rank(one_rank):
    with tiny(MODEL, tensor_parallel_size=2, enable_expert_parallel=True) as ep:
        assert_same(one_rank, run(ep))
        moe = experts(ep)
        assert (moe.num_local_experts, moe.expert_start, moe.local_intermediate) == (4, 0, 32)


# Not slow (a few seconds) and the only test of experts sharded by tensor parallelism.
def test_experts_tp2_equals_one_rank(one_rank):
    with tiny(MODEL, tensor_parallel_size=2) as tp:
        assert_same(one_rank, run(tp))
        moe = experts(tp)
        assert (moe.num_local_experts, moe.local_intermediate) == (8, 16)


def test_expert_parallel_needs_experts():
    with pytest.raises(InvalidParameterError, match="enable_expert_parallel"):
        tiny("tiny-llama", enable_expert_parallel=True)
