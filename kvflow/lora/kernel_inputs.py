"""The LoRA kernels' per-step inputs on the device (``kvflow.kernels.lora``): each row's
slot, grouped into tiles on the host once per step and copied in one transfer from
pinned memory, into buffers that never move, so CUDA graphs captured over them replay
any mix of adapters.

One int32 device buffer holds, in order: ``tile_slot`` [tile_cap] (-1 past the step's
tiles), ``slot_rank`` [S], ``rows`` [row_cap]. A step of T rows uses the first
``max_tiles(T)`` tiles; a graph of B >= T rows was captured over the first
``max_tiles(B)``, which the full ``tile_slot`` write of every step leaves at -1 past
the step's own.
"""

from __future__ import annotations

import numpy as np
import torch

from kvflow.kernels.lora import BLOCK_M_LARGE, BLOCK_M_SMALL, LoRATiles, build_tiles, max_tiles


class LoRAKernelInputs:
    def __init__(self, num_slots: int, max_tokens: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.device = device
        self.max_tokens = 0
        self._alloc(max_tokens)

    def _alloc(self, max_tokens: int) -> None:
        s = self.num_slots
        self.max_tokens = max_tokens
        self.tile_cap = max_tiles(max_tokens, s, BLOCK_M_SMALL)
        self.row_cap = max(max_tiles(max_tokens, s, bm) * bm
                           for bm in (BLOCK_M_SMALL, BLOCK_M_LARGE))
        self.rows_at = self.tile_cap + s
        size = self.rows_at + self.row_cap
        self.buf = torch.full((size,), -1, dtype=torch.int32, device=self.device)
        cuda = self.device.type == "cuda"
        # Two host buffers: a step fills one while the last step's copy may still read
        # the other; an event says when a buffer's copy has left it.
        self.host = [torch.full((size,), -1, dtype=torch.int32, pin_memory=cuda)
                     for _ in range(2)]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.turn = 0
        self.clear_on_device = False  # whether tile_slot is all -1 on the device

    def reserve(self, max_tokens: int) -> None:
        """Room for steps of ``max_tokens`` rows (before graphs are captured over the
        buffer: it does not move after that)."""
        if max_tokens > self.max_tokens:
            self._alloc(max_tokens)

    def views(self, num_tokens: int, block_m: int) -> LoRATiles:
        """The kernels' inputs for a step (or a graph) of ``num_tokens`` rows."""
        assert num_tokens <= self.max_tokens, (num_tokens, self.max_tokens)
        n = max_tiles(num_tokens, self.num_slots, block_m)
        return LoRATiles(rows=self.buf[self.rows_at:self.rows_at + n * block_m],
                         tile_slot=self.buf[:n],
                         slot_rank=self.buf[self.tile_cap:self.rows_at], block_m=block_m)

    def fill(self, token_slot: np.ndarray, slot_rank: list[int], block_m: int) -> LoRATiles:
        """Write a step's tiles (``token_slot`` [T]: each row's slot, -1: none) and the
        slots' ranks to the device; returns the step's views."""
        t = len(token_slot)
        n = max_tiles(t, self.num_slots, block_m)
        rows, tile_slot = build_tiles(token_slot, self.num_slots, block_m, n)
        i = self.turn
        self.turn ^= 1
        if self.events[i] is not None:
            self.events[i].synchronize()
        host = self.host[i].numpy()
        host[:self.tile_cap] = -1
        host[:n] = tile_slot
        host[self.tile_cap:self.rows_at] = slot_rank
        end = self.rows_at + len(rows)
        host[self.rows_at:end] = rows
        self.buf[:end].copy_(self.host[i][:end], non_blocking=True)
        if self.events[i] is not None:
            self.events[i].record()
        self.clear_on_device = False
        return self.views(t, block_m)

    def clear(self) -> None:
        """No adapter rows this step: graphs replayed now must add nothing."""
        if not self.clear_on_device:
            self.buf[:self.tile_cap].fill_(-1)
            self.clear_on_device = True
