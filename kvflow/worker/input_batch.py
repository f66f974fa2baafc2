"""The persistent batch: per-request state the worker keeps between steps.

Token ids and block tables live in preallocated numpy arrays, one row per running
request, so building a step's inputs is a handful of vectorized gathers rather than a
Python loop over tokens. Rows stay dense: removing a request moves the last row into
its place.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvflow.core.sched_output import NewRequestData
from kvflow.sampling_params import SamplingParams


@dataclass
class RequestExtras:
    """State that must survive a preemption (the row itself does not)."""

    generator: torch.Generator | None = None
    prompt_logprobs_done: int = 0  # prompt tokens whose logprobs were already sent


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.req_ids: list[str] = []
        self.index: dict[str, int] = {}
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.params: list[SamplingParams] = []
        self.eos_token_ids: list[list[int]] = []  # per row, from the scheduler's request
        # Edits to block_table since the last take_block_table_ops(), in order, so a
        # device copy can follow with small updates: ("write", row, col, ids) or
        # ("move", dst_row, src_row).
        self.record_ops = False
        self._ops: list[tuple] = []

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add(self, data: NewRequestData) -> int:
        row = len(self.req_ids)
        if row >= self.max_num_reqs:
            raise RuntimeError("input batch is full; scheduler and worker disagree")
        n = len(data.token_ids)
        self.req_ids.append(data.req_id)
        self.index[data.req_id] = row
        self.params.append(data.sampling_params)
        self.eos_token_ids.append(list(data.eos_token_ids))
        self.token_ids[row, :n] = data.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = data.num_prompt_tokens
        self.num_computed[row] = data.num_computed_tokens
        nb = len(data.block_ids)
        self.block_table[row, :nb] = data.block_ids
        self.num_blocks[row] = nb
        if self.record_ops and nb:
            self._ops.append(("write", row, 0, list(data.block_ids)))
        return row

    def append_blocks(self, req_id: str, block_ids: list[int]) -> None:
        if not block_ids:
            return
        row = self.index[req_id]
        nb = int(self.num_blocks[row])
        self.block_table[row, nb: nb + len(block_ids)] = block_ids
        self.num_blocks[row] = nb + len(block_ids)
        if self.record_ops:
            self._ops.append(("write", row, nb, list(block_ids)))

    def truncate_blocks(self, req_id: str, num_blocks: int) -> None:
        """Speculative decoding freed the table's tail (blocks of rejected drafts); the
        next append overwrites those entries, here and in a device copy alike."""
        row = self.index[req_id]
        self.num_blocks[row] = min(int(self.num_blocks[row]), num_blocks)

    def append_token(self, row: int, token_id: int) -> None:
        self.token_ids[row, self.num_tokens[row]] = token_id
        self.num_tokens[row] += 1

    def remove(self, req_id: str) -> None:
        row = self.index.pop(req_id, None)
        if row is None:
            return
        last = len(self.req_ids) - 1
        if row != last:
            moved = self.req_ids[last]
            self.req_ids[row] = moved
            self.index[moved] = row
            self.params[row] = self.params[last]
            self.eos_token_ids[row] = self.eos_token_ids[last]
            n = self.num_tokens[last]
            self.token_ids[row, :n] = self.token_ids[last, :n]
            for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed,
                        self.num_blocks):
                arr[row] = arr[last]
            nb = self.num_blocks[last]
            self.block_table[row, :nb] = self.block_table[last, :nb]
            if self.record_ops:
                self._ops.append(("move", row, last))
        self.req_ids.pop()
        self.params.pop()
        self.eos_token_ids.pop()

    def take_block_table_ops(self) -> list[tuple]:
        ops, self._ops = self._ops, []
        return ops

    def output_token_ids(self, row: int) -> np.ndarray:
        return self.token_ids[row, self.num_prompt_tokens[row]: self.num_tokens[row]]

    def prompt_token_ids(self, row: int) -> np.ndarray:
        return self.token_ids[row, : self.num_prompt_tokens[row]]
