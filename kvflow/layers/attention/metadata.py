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

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.num_decodes


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
