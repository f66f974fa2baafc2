"""What attention needs to know about the batch of one step (built by the model runner)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    # Host copies (the CPU reference loops over requests).
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Split-KV (flash-decoding) partitions chosen by the runner for long contexts.
    num_kv_splits: int = 1
    # Per-step values a backend derives once and reuses in every layer.
    backend_state: dict = field(default_factory=dict)

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.num_decodes
