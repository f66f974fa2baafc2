"""CUDA graphs for decode steps: one graph per batch size on a ladder, captured at
startup; a decode batch is padded up to the next captured size and replayed.

A graph reads its inputs from static buffers (token ids, positions, slots, sequence
lengths, block tables) and leaves the final hidden states in a static output, so a
decode step costs a few small copies and one replay instead of hundreds of kernel
launches. (Logits stay outside: [batch, vocab] outputs for every captured size would
pin gigabytes in the graph pool.)
Padding rows write nothing to the cache (slot -1) and attend to one key of block 0.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from kvflow.config import GiB
from kvflow.layers.attention import AttentionMetadata, AttentionMetadataBuilder
from kvflow.logger import init_logger
from kvflow.worker.step_inputs import StepInputs

logger = init_logger(__name__)

# Design context length for the split-KV choice baked into each graph: long enough to
# split at small batch, short enough not to over-split typical chats.
GRAPH_SPLIT_CONTEXT = 4096


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 8)) + list(range(272, 1025, 16))
    return [s for s in sizes if s <= max_num_seqs] or [1]


class CudaGraphRunner:
    """Decode graphs of ``model``, one per batch size; ``attn_builder`` builds the
    attention metadata each graph is captured with (the backend's own per-step state)."""

    def __init__(self, model: nn.Module, attn_builder: AttentionMetadataBuilder,
                 max_num_seqs: int, max_model_len: int, max_blocks: int,
                 device: torch.device) -> None:
        self.model = model
        self.attn_builder = attn_builder
        self.max_model_len = max_model_len
        self.device = device
        self.sizes = graph_batch_sizes(max_num_seqs)
        max_bs = self.sizes[-1]
        dev = device
        self.max_blocks = max_blocks
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((max_bs, self.max_blocks), dtype=torch.int32,
                                        device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        meta = AttentionMetadata(
            num_actual_tokens=bs, num_reqs=bs, num_decodes=bs, max_query_len=1,
            max_seq_len=self.max_model_len, slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1], seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs], query_start_loc_cpu=[], seq_lens_cpu=[])
        return self.attn_builder.build(
            meta, self.positions[:bs],
            split_context=min(GRAPH_SPLIT_CONTEXT, self.max_model_len))

    def _forward(self, bs: int) -> torch.Tensor:
        return self.model(self.input_ids[:bs], self.positions[:bs], self._meta(bs))

    @torch.inference_mode()
    def capture(self) -> None:
        dev = self.device
        torch.cuda.synchronize(dev)
        # The graphs' private pool is reserved through torch's allocator.
        reserved_before = torch.cuda.memory_reserved(dev)
        start = time.perf_counter()
        for bs in reversed(self.sizes):  # largest first: later graphs reuse its pool
            for _ in range(2):  # compile kernels, settle cuBLAS workspaces
                self._forward(bs)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.hidden[bs] = self._forward(bs)
            self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(dev)
        used = torch.cuda.memory_reserved(dev) - reserved_before
        logger.info("captured %d CUDA graphs (decode batch sizes %d..%d) in %.1f s using "
                    "%.2f GiB", len(self.graphs), self.sizes[0], self.sizes[-1],
                    time.perf_counter() - start, used / GiB)

    def can_run(self, inputs: StepInputs) -> bool:
        meta = inputs.meta
        return (meta.num_decodes == meta.num_reqs and meta.num_reqs <= self.sizes[-1]
                and not inputs.prompt_logprobs.indices)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Replay the smallest graph that fits; returns hidden states [R, hidden]."""
        meta = inputs.meta
        n = meta.num_reqs
        bs = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if bs > n:  # padding rows: no cache write, one key of block 0
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].fill_(1)
            self.block_tables[n:bs, 0].fill_(0)
        self.graphs[bs].replay()
        return self.hidden[bs][:n]

    def run_eager(self, inputs: StepInputs) -> torch.Tensor:
        """A step no graph covers (prefill chunks, prompt logprobs)."""
        return self.model(inputs.input_ids, inputs.positions, inputs.meta)
