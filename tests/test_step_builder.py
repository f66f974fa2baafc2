"""The worker's step builder and persistent batch, without a model: step layout, the
overlapped-step placeholders, several sampled positions per request, and row removal."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from kvflow.layers.attention import AttentionMetadata, AttentionSpec, get_attention_backend
from kvflow.layers.attention.torch_backend import TorchAttentionPlan
from kvflow.layers.rotary import RotaryEmbedding
from kvflow.sampling_params import SamplingParams
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.step_builder import StepBuilder
from kvflow.worker.step_inputs import PLACEHOLDER, SamplePlan, StepHostOutputs

BS = 4


def builder(vocab: int = 100) -> StepBuilder:
    cpu = torch.device("cpu")
    spec = AttentionSpec(block_size=BS, num_kv_heads=2, dtype=torch.float32, device=cpu,
                         rotary=RotaryEmbedding(8, 64, 10000.0))
    return StepBuilder(InputBatch(4, 64, 16), BS, cpu,
                       get_attention_backend("torch").metadata_builder(spec), vocab)


def new(rid: str, tokens: list[int], blocks: list[int], computed: int = 0,
        **params) -> NewRequestData:
    return NewRequestData(req_id=rid, token_ids=tokens, num_prompt_tokens=len(tokens),
                          sampling_params=SamplingParams(**params), block_ids=blocks,
                          num_computed_tokens=computed)


def step(new_reqs=(), cached=(), scheduled=None, finished=()) -> SchedulerOutput:
    scheduled = scheduled or {}
    return SchedulerOutput(new_reqs=list(new_reqs), cached_reqs=list(cached),
                           num_scheduled_tokens=scheduled,
                           total_num_scheduled_tokens=sum(scheduled.values()),
                           finished_req_ids=set(finished))


def test_layout_decodes_first_and_metadata_built():
    sb = builder()
    # "a" prefills 6 tokens (blocks 3, 5); "b" has 4 of 5 tokens computed: a decode.
    so = step([new("a", list(range(10, 16)), [3, 5]), new("b", [7, 8, 9, 1, 2], [0, 1], 4)],
              scheduled={"a": 6, "b": 1})
    sb.update(so)
    inp = sb.build(so)
    assert inp.req_ids == ["b", "a"]
    assert inp.input_ids.tolist() == [2, 10, 11, 12, 13, 14, 15]
    assert inp.positions.tolist() == [4, 0, 1, 2, 3, 4, 5]
    # Slot = block * BS + offset: b's position 4 is block 1 offset 0; a's 4 is block 5.
    assert inp.meta.slot_mapping.tolist() == [4, 12, 13, 14, 15, 20, 21]
    assert inp.meta.num_decodes == 1 and inp.meta.seq_lens.tolist() == [5, 6]
    assert inp.sample.logits_indices.tolist() == [0, 6]
    assert isinstance(inp.meta.backend, TorchAttentionPlan)  # built before the layers


def test_overlapped_placeholders_resolve_on_device_then_on_host():
    sb = builder()
    so = step([new("a", [5, 6, 7], [0])], scheduled={"a": 3})
    sb.update(so)
    first = sb.build(so)
    sampled = torch.tensor([42])
    slots = sb.record_sampled(first, sampled)
    row = sb.batch.index["a"]
    assert sb.batch.token_ids[row, 3] == PLACEHOLDER
    # The next step is built before the host knows token 42: it comes from the device.
    so2 = step(cached=[CachedRequestData("a", [], 3)], scheduled={"a": 1})
    sb.update(so2)
    second = sb.build(so2)
    assert second.input_ids.tolist() == [42]
    out = sb.finish(first, StepHostOutputs(sampled=sampled, slots=slots))
    assert out.sampled_token_ids == [[42]]
    assert sb.batch.token_ids[row, 3] == 42


def test_several_sampled_positions_per_request():
    """A ragged sample plan (as for draft verification): request "a" samples 3 positions,
    "b" one; each request's tokens join its sequence and come back in order."""
    sb = builder()
    so = step([new("a", [1, 2, 3, 4], [0, 1]), new("b", [9, 8], [2])],
              scheduled={"a": 4, "b": 2})
    sb.update(so)
    inp = sb.build(so)
    inp.sample = SamplePlan(req_indices=np.array([0, 1]), offsets=np.array([0, 3, 4]),
                            logits_indices=torch.tensor([1, 2, 3, 5]))
    assert len(sb.sampling_metadata(inp).temperature) == 4  # one row per sampled position
    sampled = torch.tensor([70, 71, 72, 80])
    slots = sb.record_sampled(inp, sampled)
    ra, rb = sb.batch.index["a"], sb.batch.index["b"]
    assert sb.batch.num_tokens[ra] == 7 and sb.batch.num_tokens[rb] == 3
    assert sb.pending.source("a", 6) == 2 and sb.pending.source("b", 2) == 3
    with pytest.raises(RuntimeError):
        sb.pending.source("a", 7)
    out = sb.finish(inp, StepHostOutputs(sampled=sampled, slots=slots))
    assert out.sampled_token_ids == [[70, 71, 72], [80]]
    assert sb.batch.token_ids[ra, :7].tolist() == [1, 2, 3, 4, 70, 71, 72]


def test_top_k_at_or_above_vocab_and_huge_ints_are_safe():
    """Defence in depth behind SamplingParams validation: values no valid request has
    (set after validation here) still become tensors without overflow or bad indices."""
    sb = builder(vocab=100)
    reqs = [new("a", [1], [0], top_k=100, temperature=1.0),
            new("b", [1], [1], top_k=7, temperature=1.0, seed=-1),
            new("c", [1], [2], top_k=5, temperature=1.0, logprobs=3, min_tokens=3,
                stop_token_ids=[3])]
    bad = reqs[1].sampling_params
    bad.top_k, bad.seed = 2**70, 2**80
    reqs[2].sampling_params.logprobs = 10**9
    reqs[2].sampling_params.min_tokens = 2**70  # valid with max_tokens=None
    reqs[2].sampling_params.all_stop_token_ids = {3, 10**12}
    so = step(reqs, scheduled={"a": 1, "b": 1, "c": 1})
    sb.update(so)
    meta = sb.sampling_metadata(sb.build(so))
    assert meta.top_k.tolist() == [100, 100, 5]  # at/above the vocabulary: no limit
    assert meta.max_num_logprobs == 100
    assert meta.banned[1].tolist() == [3]  # ids outside the vocabulary cannot be sampled
    assert sb.extras["b"].generator is not None
    only_vocab = step([new("d", [1], [3], top_k=100, temperature=1.0)], scheduled={"d": 1})
    sb.update(only_vocab)
    assert sb.sampling_metadata(sb.build(only_vocab)).top_k is None  # filter skipped


def test_input_batch_remove_moves_last_row_into_the_gap():
    b = InputBatch(4, 16, 4)
    b.record_ops = True
    for rid, toks, blocks in (("a", [1, 2], [0]), ("b", [3, 4, 5], [1, 2]), ("c", [6], [3])):
        b.add(new(rid, toks, blocks))
    b.take_block_table_ops()
    b.remove("a")
    assert b.req_ids == ["c", "b"] and b.index == {"c": 0, "b": 1}
    assert b.token_ids[0, :1].tolist() == [6] and b.num_tokens[0] == 1
    assert b.block_table[0, :1].tolist() == [3] and b.num_blocks[0] == 1
    assert b.take_block_table_ops() == [("move", 0, 2)]
    b.remove("b")  # the last row: nothing moves
    assert b.req_ids == ["c"] and b.take_block_table_ops() == []
    b.remove("missing")  # unknown ids are ignored
    assert b.num_reqs == 1 and len(b.params) == 1


def test_triton_metadata_builder_chooses_kv_splits_from_the_step():
    """The split-KV choice lives in the Triton backend's builder: per step from its decode
    count and longest context, or from a fixed context for captured CUDA graphs."""
    from kvflow.layers.attention.triton_backend import TritonAttentionMetadata

    cpu = torch.device("cpu")
    spec = AttentionSpec(block_size=16, num_kv_heads=8, dtype=torch.bfloat16, device=cpu,
                         num_sms=132)
    tb = get_attention_backend("triton").metadata_builder(spec)

    def splits(num_decodes, num_reqs, max_seq_len, **kw):
        meta = AttentionMetadata(
            num_actual_tokens=num_reqs, num_reqs=num_reqs, num_decodes=num_decodes,
            max_query_len=1, max_seq_len=max_seq_len, slot_mapping=torch.zeros(num_reqs),
            query_start_loc=torch.zeros(num_reqs + 1), seq_lens=torch.zeros(num_reqs),
            block_tables=torch.zeros(num_reqs, 1), query_start_loc_cpu=[], seq_lens_cpu=[])
        built = tb.build(meta, torch.zeros(num_reqs, dtype=torch.int64), **kw).backend
        assert isinstance(built, TritonAttentionMetadata)
        return built.num_kv_splits

    assert splits(1, 1, 4096) == 16  # one long decode spreads over the SMs
    assert splits(0, 2, 4096) == 1  # no decodes: nothing to split
    assert splits(1, 1, 100) == 1  # too short to split
    assert splits(1, 1, 100_000, split_context=4096) == 16  # a graph's fixed choice
