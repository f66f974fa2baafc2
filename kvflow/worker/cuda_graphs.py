"""CUDA graphs for decode steps: one graph per batch size on a ladder, captured at
startup; a decode batch is padded up to the next captured size and replayed.

A graph reads its inputs from static buffers (token ids, positions, slots, sequence
lengths, block tables) and leaves the final hidden states in a static output, so a
decode step costs a few small copies and one replay instead of hundreds of kernel
launches. (Logits stay outside: [batch, vocab] outputs for every captured size would
pin gigabytes in the graph pool.)
Padding rows write nothing to the cache (slot -1) and attend to one key of block 0.
With LoRA (``lora``: the LoRA worker), graphs are captured with the LoRA kernels on over
the worker's static tile buffers (``kvflow/lora/kernel_inputs.py``), which each step
fills before the replay: steps with adapter rows replay too (padding rows: no slot).

Verification steps (speculative decoding, chains of drafts) get graphs too, one per
(batch size, query length q) for steps of at most that many requests with at most q
tokens each: a request verifying d drafts has d + 1 of them, so q runs over 2..k + 1
(``verify_query_lens``) and the batch over the decode ladder up to the size where
speculation switches itself off. The attention is the prefill launch of the paged
kernel (causal queries over the paged context). Its grid (cdiv(q, BLOCK_Q), batch, KV
heads) is fixed by the key; everything else it reads from device buffers, so the
step's own layout goes in as it is: the real tokens fill rows 0..T-1 with their own
query_start_loc and seq_lens (the same attention as the eager step, no padding inside a
request), and the graph's remaining rows bs * q - T form one padding request after the
real ones (no cache writes, slot -1; it attends to one key of block 0; rows the grid
does not reach stay unwritten), then empty requests up to bs. Every layer works row by
row, so whatever the padding rows hold never reaches a real row, and they are dropped.
Candidate trees (Medusa) get graphs of their own (``capture_trees``, query lengths up to
1 + the tree's nodes): the kernel's tree launch reads each token's 64-bit mask and each
request's tree root from two more static buffers (the padding request: no tree).

Short prefills get the same kind of graph (``prefill_lens``, ``KVFLOW_PREFILL_GRAPHS``):
a step of one request with at most 512 new tokens (a prompt, a prompt's last chunk, a
prompt behind a cached prefix) replays the (1, q) graph of the next rung of
``prefill_query_lens``. Eagerly such a step is host-bound (hundreds of launches: about
17 ms at 8B for a 128-token prompt whose kernels take about 5), so this is what an idle
engine's time to first token is made of. The prefill launch of the attention reads the
request's own query_start_loc and seq_lens as the eager step does; its rows past the
prompt are the padding request. Up to a few hundred rows the linears cost what one row
costs (they read the weights once), so padding up to the rung is nearly free.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
from torch import nn

from kvflow.config import GiB
from kvflow.layers.attention import AttentionMetadata, AttentionMetadataBuilder
from kvflow.layers.attention.metadata import TreeAttention
from kvflow.logger import init_logger
from kvflow.worker.step_inputs import StepInputs

logger = init_logger(__name__)

# Design context length for the split-KV choice baked into each graph: long enough to
# split at small batch, short enough not to over-split typical chats.
GRAPH_SPLIT_CONTEXT = 4096


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 8)) + list(range(272, 1025, 16))
    return [s for s in sizes if s <= max_num_seqs] or [1]


def verify_query_lens(num_speculative_tokens: int) -> list[int]:
    """Query lengths (1 + drafts) that get verification graphs: every one up to 9, then
    a few rungs, then k + 1 (a step is padded up to the next captured length)."""
    top = num_speculative_tokens + 1
    lens = set(range(2, min(top, 9) + 1)) | {q for q in (13, 17, 33) if q < top} | {top}
    return sorted(q for q in lens if q >= 2)


def verify_batch_sizes(max_num_seqs: int, disable_by_batch_size: int | None,
                       cap: int = 32) -> list[int]:
    """Batch sizes of the verification graphs: the decode ladder up to the batch size
    above which speculation switches itself off (``cap`` when it never does)."""
    limit = cap if disable_by_batch_size is None else min(disable_by_batch_size, cap)
    sizes = [s for s in graph_batch_sizes(max_num_seqs) if s <= max(limit, 1)]
    bigger = [s for s in graph_batch_sizes(max_num_seqs) if s >= limit]
    if sizes and sizes[-1] < limit and bigger:
        sizes.append(bigger[0])  # cover the limit itself
    return sizes


PREFILL_LENS = (16, 32, 64, 128, 192, 256, 384, 512)


def prefill_query_lens(max_num_batched_tokens: int, max_model_len: int) -> list[int]:
    """Query lengths of the one-request prefill graphs: the rungs of ``PREFILL_LENS`` a
    step can reach (at most the token budget and the context length)."""
    top = min(max_num_batched_tokens, max_model_len)
    return [q for q in PREFILL_LENS if q <= top]


def prefill_graphs_on(device: torch.device) -> bool:
    """``KVFLOW_PREFILL_GRAPHS``: ``on``/``off``, or (``auto``) this GPU's measured default
    (``kernels/decode_defaults.py``; off where unmeasured)."""
    from kvflow import envs
    from kvflow.kernels.decode_defaults import switch_on

    return switch_on(envs.prefill_graphs(), "prefill_graphs", device)


def pick_verify_graph(num_reqs: int, max_query_len: int, sizes: list[int],
                      lens: list[int]) -> tuple[int, int] | None:
    """(batch size, query length) of the smallest verification graph that holds a step
    of ``num_reqs`` requests with at most ``max_query_len`` tokens each, or None."""
    if not sizes or not lens or num_reqs > sizes[-1] or max_query_len > lens[-1] \
            or max_query_len < 2:
        return None
    return (next(s for s in sizes if s >= num_reqs),
            next(q for q in lens if q >= max_query_len))


class CudaGraphRunner:
    """Decode graphs of ``model``, one per batch size, verification graphs, one per
    (batch size, query length) (``verify_sizes`` x ``verify_lens``; empty without
    speculation), and one-request prefill graphs, one per query length in
    ``prefill_lens`` (empty: none); ``attn_builder`` builds the attention metadata each
    graph is captured with (the backend's own per-step state)."""

    def __init__(self, model: nn.Module, attn_builder: AttentionMetadataBuilder,
                 max_num_seqs: int, max_model_len: int, max_blocks: int,
                 device: torch.device, verify_sizes: list[int] = (),
                 verify_lens: list[int] = (), prefill_lens: list[int] = (),
                 lora=None) -> None:
        self.model = model
        self.attn_builder = attn_builder
        self.max_model_len = max_model_len
        self.device = device
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.verify_sizes = list(verify_sizes)
        self.verify_lens = list(verify_lens) if self.verify_sizes else []
        self.tree_lens: list[int] = []  # query lengths of the tree graphs (capture_trees)
        self.prefill_lens = sorted(prefill_lens)
        max_bs = max(self.sizes[-1], self.verify_sizes[-1] if self.verify_sizes else 0)
        # Room for chains of verify_lens, trees of up to 63 nodes (64 tokens) and the
        # longest one-request prefill.
        max_tokens = max(max_bs, self.verify_sizes[-1] * max(self.verify_lens + [64])
                         if self.verify_sizes else 0, max(self.prefill_lens, default=0))
        # LoRA: forwards of t rows run its kernels over static buffers (graph_step(t))
        self._lora_step = nullcontext if lora is None else lora.graph_step
        if lora is not None:
            lora.reserve_graph_tokens(max_tokens)
        dev = device
        self.max_blocks = max_blocks
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((max_bs, self.max_blocks), dtype=torch.int32,
                                        device=dev)
        # Verification graphs' query_start_loc: the step's own, then the padding request.
        self.verify_qsl = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        # Tree graphs: each token's mask bits (-1: not in a tree) and each tree's root.
        self.tree_bits = torch.full((max_tokens,), -1, dtype=torch.int64, device=dev)
        self.tree_start = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        # (batch size, query length, tree) -> graph, hidden states
        self.verify_graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self.verify_hidden: dict[tuple[int, int, bool], torch.Tensor] = {}
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
        with self._lora_step(bs):
            return self.model(self.input_ids[:bs], self.positions[:bs], self._meta(bs))

    def _verify_meta(self, bs: int, q: int, tree: bool = False) -> AttentionMetadata:
        t = bs * q
        meta = AttentionMetadata(
            num_actual_tokens=t, num_reqs=bs, num_decodes=0, max_query_len=q,
            max_seq_len=self.max_model_len, slot_mapping=self.slot_mapping[:t],
            query_start_loc=self.verify_qsl[: bs + 1], seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs], query_start_loc_cpu=[], seq_lens_cpu=[],
            tree=TreeAttention(sizes_cpu=[], visible_cpu=[], bits=self.tree_bits[:t],
                               start=self.tree_start[:bs]) if tree else None)
        return self.attn_builder.build(meta, self.positions[:t])

    def _verify_forward(self, bs: int, q: int, tree: bool = False) -> torch.Tensor:
        t = bs * q
        with self._lora_step(t):
            return self.model(self.input_ids[:t], self.positions[:t],
                              self._verify_meta(bs, q, tree))

    def _capture_verify(self, lens: list[int], tree: bool,
                        sizes: list[int] | None = None) -> None:
        """Graphs for (each of ``sizes``, default the verify sizes, each of ``lens``),
        captured on q tokens per request (any layout of at most bs * q tokens replays).
        A key captured before (a verification graph a prefill rung shares) is kept."""
        self.seq_lens.fill_(max(lens, default=1))
        self.tree_start.fill_(max(lens, default=1))  # no tree while capturing
        for q in reversed(lens):
            for bs in reversed(self.verify_sizes if sizes is None else sizes):
                if (bs, q, tree) in self.verify_graphs:
                    continue
                torch.arange(0, (bs + 1) * q, q, out=self.verify_qsl[: bs + 1])
                self.verify_graphs[bs, q, tree], self.verify_hidden[bs, q, tree] = \
                    self._capture(lambda: self._verify_forward(bs, q, tree))
        self.seq_lens.fill_(1)

    @torch.inference_mode()
    def capture_trees(self, num_nodes: int) -> None:
        """Graphs for candidate-tree verification steps of up to ``num_nodes`` nodes (the
        runner calls it when the proposer verifies a tree; benchmarks when they set one)."""
        if not self.verify_sizes:
            return
        lens = verify_query_lens(num_nodes)
        start = time.perf_counter()
        self._capture_verify(lens, True)
        self.tree_lens = sorted(set(self.tree_lens) | set(lens))
        torch.cuda.synchronize(self.device)
        logger.info("captured tree verification graphs (batch sizes %s, query lengths %s) "
                    "in %.1f s", self.verify_sizes, lens, time.perf_counter() - start)

    @torch.inference_mode()
    def capture(self) -> None:
        dev = self.device
        torch.cuda.synchronize(dev)
        # The graphs' private pool is reserved through torch's allocator.
        reserved_before = torch.cuda.memory_reserved(dev)
        start = time.perf_counter()
        # The longest prefill first: its activations are the pool's largest.
        self._capture_verify(self.prefill_lens, False, sizes=[1])
        for bs in reversed(self.sizes):  # largest first: later graphs reuse its pool
            self.graphs[bs], self.hidden[bs] = self._capture(lambda: self._forward(bs))
        self._capture_verify(self.verify_lens, False)
        torch.cuda.synchronize(dev)
        used = torch.cuda.memory_reserved(dev) - reserved_before
        logger.info("captured %d CUDA graphs (decode batch sizes %d..%d%s%s) in %.1f s using "
                    "%.2f GiB", len(self.graphs) + len(self.verify_graphs), self.sizes[0],
                    self.sizes[-1],
                    f"; verification: batch sizes {self.verify_sizes}, query lengths "
                    f"{self.verify_lens}" if self.verify_lens else "",
                    f"; one-request prefills of up to {self.prefill_lens[-1]} tokens "
                    f"({len(self.prefill_lens)} lengths)" if self.prefill_lens else "",
                    time.perf_counter() - start, used / GiB)

    def _capture(self, forward) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        for _ in range(2):  # compile kernels, settle cuBLAS workspaces
            forward()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = forward()
        self.pool = graph.pool()
        return graph, hidden

    def _pick(self, meta: AttentionMetadata) -> tuple[int, int, bool] | None:
        """The (batch size, query length, tree) key of the graph a step that is not
        decode-only replays: a verification graph, else a one-request prefill graph;
        None: the step runs eagerly."""
        tree = meta.tree is not None
        key = pick_verify_graph(meta.num_reqs, meta.max_query_len, self.verify_sizes,
                                self.tree_lens if tree else self.verify_lens)
        if key is not None:
            return (*key, tree)
        if (self.prefill_lens and not tree and meta.num_reqs == 1
                and 2 <= meta.max_query_len <= self.prefill_lens[-1]):
            return 1, next(q for q in self.prefill_lens if q >= meta.max_query_len), False
        return None

    def can_run(self, inputs: StepInputs) -> bool:
        meta = inputs.meta
        if inputs.prompt_logprobs.indices:
            return False
        if meta.num_decodes == meta.num_reqs:
            return meta.num_reqs <= self.sizes[-1]
        return self._pick(meta) is not None

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Replay the smallest graph that fits; returns hidden states [T, hidden]."""
        meta = inputs.meta
        if meta.num_decodes != meta.num_reqs:
            return self._run_verify(inputs)
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

    def _run_verify(self, inputs: StepInputs) -> torch.Tensor:
        """A step of at most q tokens per request (drafts to verify, or one short
        prefill) in the (bs, q) graph: its tokens first, the rest of the graph's rows a
        padding request."""
        meta = inputs.meta
        r, n = meta.num_reqs, meta.num_actual_tokens
        bs, q, tree = self._pick(meta)
        t = bs * q
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:t].fill_(-1)
        self.verify_qsl[: r + 1].copy_(meta.query_start_loc)
        self.verify_qsl[r + 1: bs + 1].fill_(t)  # request r: rows n..t-1, then empty ones
        self.seq_lens[:r].copy_(meta.seq_lens)
        # The padding request sees one key of block 0 (its rows are dropped; the
        # kernel gives rows before that key zeros).
        self.seq_lens[r:bs].fill_(1)
        width = meta.block_tables.shape[1]
        self.block_tables[:r, :width].copy_(meta.block_tables)
        self.block_tables[r:bs, 0].fill_(0)
        if tree:  # the step's masks and roots; the padding request has no tree
            self.tree_bits[:n].copy_(meta.tree.bits)
            self.tree_bits[n:t].fill_(-1)
            self.tree_start[:r].copy_(meta.tree.start)
            self.tree_start[r:bs].fill_(1)
        self.verify_graphs[bs, q, tree].replay()
        return self.verify_hidden[bs, q, tree][:n]

    def run_eager(self, inputs: StepInputs) -> torch.Tensor:
        """A step no graph covers (prefill chunks, prompt logprobs)."""
        return self.model(inputs.input_ids, inputs.positions, inputs.meta)
