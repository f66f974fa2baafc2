"""Per-request block tables on top of the block pool (pure Python).

A request's block table only grows (DESIGN rule 3): block i holds the K/V of token
positions [i * block_size, (i + 1) * block_size).
"""

from __future__ import annotations

from kvflow.core.block_pool import BlockPool, KVBlock
from kvflow.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates, shares and frees the KV blocks of requests."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[KVBlock]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        Returns the ids of the blocks added to its table (possibly none), or None when
        there are not enough free blocks; in that case nothing changes.
        """
        held = self._blocks.setdefault(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens
        need = self.blocks_needed(total) - len(held)
        if need <= 0:
            return []
        if need > self.pool.num_free_blocks:
            return None
        new = self.pool.allocate(need)
        held.extend(new)
        new_ids = [b.block_id for b in new]
        request.block_ids.extend(new_ids)
        return new_ids

    def fork(self, parent: Request, child: Request, parent_computed: int) -> int:
        """Share the parent's full blocks of the common prompt with ``child``.

        Only blocks the parent has computed and will never write again are shared, and
        the child always computes at least the last prompt token itself (it needs that
        position's logits to sample its own first token). ``parent_computed`` counts the
        parent's tokens whose K/V are already in the cache. Returns the number of tokens
        the child can skip.
        """
        parent_blocks = self._blocks.get(parent.request_id)
        if not parent_blocks or child.block_ids:
            return 0
        common = min(parent_computed, child.num_prompt_tokens - 1)
        n_blocks = min(common // self.block_size, len(parent_blocks))
        if n_blocks == 0:
            return 0
        shared = parent_blocks[:n_blocks]
        self.pool.touch(shared)
        self._blocks[child.request_id] = list(shared)
        child.block_ids = [b.block_id for b in shared]
        child.num_computed_tokens = n_blocks * self.block_size
        child.num_cached_tokens = child.num_computed_tokens
        return child.num_computed_tokens

    def free(self, request: Request) -> None:
        """Drop the request's references; its blocks return to the pool at refcount 0."""
        blocks = self._blocks.pop(request.request_id, [])
        self.pool.release(list(reversed(blocks)))
        request.block_ids = []

    def ref_counts(self) -> list[int]:
        """Reference count of every block (tests and leak checks)."""
        return [b.ref_cnt for b in self.pool.blocks]
