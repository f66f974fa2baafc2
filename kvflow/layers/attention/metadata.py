"""What attention needs to know about the batch of one step.

The step builder (``kvflow.worker.step_builder``) fills the fields every backend reads;
then the backend's metadata builder (``AttentionBackend.metadata_builder``) derives its
own per-step state once, before the first layer runs, and stores it in ``backend``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvflow.layers.rotary import RotaryEmbedding


@dataclass
class AttentionMetadata:
    """The batch of one step, in the layout every backend reads.

    Requests are ordered decodes first (one new token each), then prefill chunks. The
    new tokens of request i are ``query_start_loc[i]:query_start_loc[i+1]`` in the flat
    token dimension; they sit at positions ``seq_lens[i] - q_len_i ... seq_lens[i] - 1``
    of the sequence, and attend causally to everything before them.
    """

    num_actual_tokens: int  # T; rows beyond it are padding (CUDA graphs)
    num_reqs: int  # R
    num_decodes: int  # requests 0..num_decodes-1 have exactly one new token
    max_query_len: int
    max_seq_len: int
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset, -1 = skip
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32, context length after this step
    block_tables: torch.Tensor  # [R, max_blocks] int32
    # Host copies (the CPU backend plans per request from them).
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # What the backend's metadata builder derived for this step (its own type:
    # TorchAttentionPlan, TritonAttentionMetadata); None until built.
    backend: object | None = field(default=None)
    # Candidate trees (Medusa) among the step's queries; None: plain causal attention.
    tree: "TreeAttention | None" = None

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.num_decodes


@dataclass
class TreeAttention:
    """Requests whose last ``sizes[i]`` query tokens are a candidate tree (root, then
    nodes in breadth-first order; kvflow/spec_decode/tree.py). Tree token a of a request
    sees every key before the tree, and tree token b only if ``visible[i][a, b]``; keys
    and queries outside trees attend causally as usual.
    """

    sizes_cpu: list[int]  # [R] tree tokens at the end of each request's query (0: none)
    visible_cpu: list  # [R] np.ndarray [size, size] bool, or None where size is 0
    bits: torch.Tensor  # [T] int64: bit b = the token sees tree token b; -1 outside trees
    start: torch.Tensor  # [R] int32: sequence index of the tree's root (seq_len: none)

    @classmethod
    def build(cls, visible: list, query_start_loc: list[int], seq_lens: list[int],
              device: torch.device) -> "TreeAttention":
        """``visible[i]``: request i's [size, size] bool tree mask (None: no tree); its
        tree is the last ``size`` of its queries."""
        import numpy as np

        bits = np.full(query_start_loc[-1], -1, dtype=np.int64)
        start = np.asarray(seq_lens, dtype=np.int32).copy()
        sizes = []
        for i, vis in enumerate(visible):
            size = 0 if vis is None else vis.shape[0]
            sizes.append(size)
            if not size:
                continue
            if size > 64:
                raise ValueError(f"a tree of {size} tokens does not fit a 64-bit mask")
            weights = np.left_shift(np.uint64(1), np.arange(size, dtype=np.uint64))
            row_bits = (vis.astype(np.uint64) * weights[None, :]).sum(axis=1, dtype=np.uint64)
            end = query_start_loc[i + 1]
            bits[end - size: end] = row_bits.view(np.int64)
            start[i] = seq_lens[i] - size
        return cls(sizes_cpu=sizes, visible_cpu=list(visible),
                   bits=torch.from_numpy(bits).to(device),
                   start=torch.from_numpy(start).to(device))


@dataclass(frozen=True, eq=False)
class AttentionSpec:
    """What a backend's metadata builder knows for the whole run: the cache layout, the
    device, and the model's one rotary table (a step's cos/sin rows are planned with the
    rest of the step)."""

    block_size: int
    num_kv_heads: int
    dtype: torch.dtype  # KV cache dtype
    device: torch.device
    rotary: RotaryEmbedding | None = None
    num_sms: int = 1  # streaming multiprocessors (split-KV choice on the GPU)
    # --deterministic (docs/determinism.md): split-KV by a fixed number of keys, sized
    # from max_model_len once, instead of by the batch
    deterministic: bool = False
    max_model_len: int = 0
