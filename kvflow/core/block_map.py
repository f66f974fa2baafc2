"""A picture of the KV block pool for the dashboard (pure Python).

Each block is free, in use by one request, cached and evictable (free, but its prefix
can still be found and reused), or shared (held by several requests). The map folds the
pool into at most ``cells`` cells of consecutive blocks, each showing the most notable
state among its blocks (shared > in use > cached > free), so a pool of any size draws in
the same space.
"""

from __future__ import annotations

from collections.abc import Sequence

FREE, USED, CACHED, SHARED = "0", "1", "2", "3"
_RANK = {FREE: 0, CACHED: 1, USED: 2, SHARED: 3}


def block_state(ref_cnt: int, block_hash: object) -> str:
    if ref_cnt > 1:
        return SHARED
    if ref_cnt == 1:
        return USED
    return CACHED if block_hash is not None else FREE


def block_map(blocks: Sequence, cells: int = 512) -> tuple[str, dict[str, int]]:
    """(map string of one digit per cell, counts per state) of a pool's KVBlocks."""
    counts = {"free": 0, "used": 0, "cached": 0, "shared": 0}
    names = {FREE: "free", USED: "used", CACHED: "cached", SHARED: "shared"}
    n = len(blocks)
    per_cell = max(1, -(-n // cells))
    out: list[str] = []
    best = FREE
    for i, b in enumerate(blocks):
        s = block_state(b.ref_cnt, b.block_hash)
        counts[names[s]] += 1
        if _RANK[s] > _RANK[best]:
            best = s
        if (i + 1) % per_cell == 0 or i == n - 1:
            out.append(best)
            best = FREE
    return "".join(out), counts
