"""A device-side mirror of the persistent batch's block table.

Copying whole block-table rows to the GPU every step costs max_model_len / block_size
entries per request (8192 for a 128k context); instead the batch logs its edits (a few
new block ids per step, a row move when a request leaves) and this mirror replays them.
A step's table is then one gather on the device.
"""

from __future__ import annotations

import torch

from kvflow.worker.transfer import to_device


class DeviceBlockTable:
    def __init__(self, max_reqs: int, max_blocks: int, device: torch.device) -> None:
        self.table = torch.zeros((max_reqs, max_blocks), dtype=torch.int32, device=device)
        self.device = device

    def apply(self, ops: list[tuple]) -> None:
        rows: list[int] = []
        cols: list[int] = []
        vals: list[int] = []

        def flush() -> None:
            if rows:
                idx = (to_device(rows, self.device, torch.int64),
                       to_device(cols, self.device, torch.int64))
                self.table.index_put_(idx, to_device(vals, self.device, torch.int32))
                rows.clear(), cols.clear(), vals.clear()

        for op in ops:
            if op[0] == "move":
                flush()
                self.table[op[1]].copy_(self.table[op[2]])
            else:
                _, row, col, ids = op
                rows.extend([row] * len(ids))
                cols.extend(range(col, col + len(ids)))
                vals.extend(ids)
        flush()

    def gather(self, rows: torch.Tensor, width: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of the table (in step order), first ``width`` columns -> [R, width]."""
        return torch.index_select(self.table[:, :width], 0, rows, out=out)
