"""Per-request block tables on top of the block pool, with automatic prefix caching,
copy-on-write and swapping (pure Python).

A request's block table only grows (rule 3 of docs/architecture.md): block i holds the
K/V of token positions [i * block_size, (i + 1) * block_size). With prefix caching, every full block
gets a chained hash of (parent block's hash, its token ids, an optional cache salt); a new
request reuses the longest run of cached blocks that starts its prompt. Freed blocks keep
their hash until they are reused, so evictions take the least recently freed first.

With ``sliding_window`` (a model whose every layer is windowed, e.g. Mistral v0.1) a
request's blocks that no future query can see (wholly before the window of its next
token) go back to the pool as it advances: its table keeps their (stale) ids at their
positions, which only windowed attention, reading from the window's first block on,
is given (docs/models.md).
"""

from __future__ import annotations

import hashlib
import struct

from kvflow.core.block_pool import BlockPool, KVBlock
from kvflow.core.request import Request
from kvflow.utils import cdiv


def hash_block(parent: bytes | None, tokens: list[int], salt: str | None = None) -> bytes:
    """Content hash of one full block, chained to its parent (a 128-bit BLAKE2b digest,
    so no two prefixes share a key by accident or by construction)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0")
    if salt is not None and parent is None:
        h.update(salt.encode())
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


def freeable_window(config) -> int | None:
    """The window behind which an engine's requests may give blocks back: the model's,
    when every layer has that one window (a full-attention layer needs every block, and
    the block table is shared by all layers), the cache is paged, and no draft model or
    head reads the same block table with attention of its own. ``config``: EngineConfig."""
    windows = set(config.model.arch.layer_windows)
    if len(windows) != 1 or None in windows or config.cache.kv_layout != "paged":
        return None
    spec = config.speculative
    if spec is not None and spec.method in ("draft_model", "eagle_mlp", "medusa"):
        return None
    return windows.pop()


class KVCacheManager:
    """Allocates, shares, caches and frees the KV blocks of requests."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 sliding_window: int | None = None, cache_outputs: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        # False: only blocks wholly inside a request's prompt are offered to the cache. A
        # batch-invariant engine computes prompt rows and generated rows differently (the
        # CPU step's bf16 prompt rows, int8 generated ones; the GPU's prefill and decode
        # launches): a later prompt that repeats another request's output (the next turn
        # of a chat) must compute it as a prompt, whether or not those blocks are cached.
        self.cache_outputs = cache_outputs
        self.sliding_window = sliding_window
        self.num_window_freed = 0  # blocks given back behind a window (a counter)
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[KVBlock]] = {}
        # Per request: how many of its leading blocks were already offered to the cache.
        self._num_registered: dict[str, int] = {}
        # (src, dst) block copies the worker must make before the next step (copy-on-write).
        self.pending_copies: list[tuple[int, int]] = []
        self.num_copied_blocks = 0  # copy-on-write copies so far (a counter for stats)
        # Prefix-cache statistics (kept by the scheduler on admission): tokens of admitted
        # requests, and how many of them came from the cache.
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # --- prefix caching ---------------------------------------------------------------
    def _block_hashes(self, request: Request, num_tokens: int) -> list[bytes]:
        """Hashes of the full blocks among the request's first ``num_tokens`` tokens."""
        hashes = request.block_hashes
        bs = self.block_size
        full = min(num_tokens, len(request.all_token_ids)) // bs
        while len(hashes) < full:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None,
                                     request.all_token_ids[i * bs: (i + 1) * bs],
                                     request.cache_salt))
        return hashes[:full]

    def get_computed_blocks(self, request: Request) -> int:
        """Give a request just admitted the longest cached prefix of its tokens; returns
        the number of tokens it can skip. At least one token is always left to compute
        (its hidden state gives the logits of the next token); when every block is cached,
        that last token is written into the last cached block (copied first if shared)."""
        if not self.enable_caching or request.block_ids:
            return 0
        hashes = self._block_hashes(request, request.num_tokens)
        hits: list[KVBlock] = []
        for h in hashes:
            block = self.pool.cached.get(h)
            if block is None:
                break
            hits.append(block)
        if hits:
            self.pool.touch(hits)
            self._blocks[request.request_id] = hits
            request.block_ids = [b.block_id for b in hits]
            request.num_computed_tokens = min(len(hits) * self.block_size,
                                              request.num_tokens - 1)
            request.num_cached_tokens = request.num_computed_tokens
        return request.num_computed_tokens

    def _cache_full_blocks(self, request: Request) -> None:
        """Register the request's full, computed blocks under their content hashes."""
        held = self._blocks.get(request.request_id)
        if not self.enable_caching or not held:
            return
        rid = request.request_id
        start = self._num_registered.get(rid, 0)
        upto = request.num_computed_tokens if self.cache_outputs else min(
            request.num_computed_tokens, request.num_prompt_tokens)
        hashes = self._block_hashes(request, upto)
        for i in range(start, min(len(held), len(hashes))):
            block, h = held[i], hashes[i]
            if block is None:  # freed behind the window (registered before that)
                continue
            if block.block_hash is None and h not in self.pool.cached:
                block.block_hash = h
                self.pool.cached[h] = block
        self._num_registered[rid] = max(start, min(len(held), len(hashes)))

    # --- allocation ---------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        Blocks computed so far are registered in the prefix cache first. If the block the
        new tokens start in is shared, the request gets its own copy of it (copy-on-write).
        Returns the ids of the blocks added to its table (possibly none), or None when
        there are not enough free blocks; in that case nothing changes.
        """
        held = self._blocks.setdefault(request.request_id, [])
        self._cache_full_blocks(request)
        if self.sliding_window is not None:
            self._free_behind_window(request, held)
        total = request.num_computed_tokens + num_new_tokens
        need = self.blocks_needed(total) - len(held)
        first = request.num_computed_tokens // self.block_size
        cow = first < len(held) and held[first].ref_cnt > 1
        if max(need, 0) + cow > self.pool.num_free_blocks:
            return None
        if cow:
            self._copy_on_write(request, first)
        if need <= 0:
            return []
        new = self.pool.allocate(need)
        held.extend(new)
        new_ids = [b.block_id for b in new]
        request.block_ids.extend(new_ids)
        return new_ids

    def _free_behind_window(self, request: Request, held: list[KVBlock | None]) -> None:
        """Release the blocks wholly before the window of the request's next query
        (position num_computed_tokens sees keys from num_computed - window + 1 on)."""
        first_needed = request.num_computed_tokens - self.sliding_window + 1
        end = min(max(first_needed, 0) // self.block_size, len(held))
        dropped = [b for b in held[:end] if b is not None]
        if not dropped:
            return
        for i in range(end):
            held[i] = None
        self.num_window_freed += len(dropped)
        self.pool.release(dropped)

    def trim(self, request: Request) -> bool:
        """Free the request's blocks past its computed tokens (speculative decoding: they
        held only rejected draft tokens), newest first. Returns whether any were freed."""
        held = self._blocks.get(request.request_id)
        keep = self.blocks_needed(request.num_computed_tokens)
        if not held or len(held) <= keep:
            return False
        dropped = held[keep:]
        del held[keep:]
        del request.block_ids[keep:]
        rid = request.request_id
        if self._num_registered.get(rid, 0) > keep:
            self._num_registered[rid] = keep
        # Newest first, so the oldest dropped block (the next one the request will need)
        # ends at the head of the free queue and is handed back to it first.
        self.pool.release_unused(list(reversed(dropped)))
        return True

    def _copy_on_write(self, request: Request, index: int) -> None:
        held = self._blocks[request.request_id]
        old = held[index]
        (new,) = self.pool.allocate(1)
        self.pending_copies.append((old.block_id, new.block_id))
        self.num_copied_blocks += 1
        self.pool.release([old])
        held[index] = new
        request.block_ids[index] = new.block_id

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def fork(self, parent: Request, child: Request, parent_computed: int) -> int:
        """Share the parent's blocks of the common prompt with ``child``.

        The child computes the last prompt token itself (it needs that position's logits
        to sample its own first token), writing into the last shared block; that block is
        then copied for it first (copy-on-write), so the parent's stays intact.
        ``parent_computed`` counts the parent's tokens whose K/V are already in the cache.
        Returns the number of tokens the child can skip.
        """
        parent_blocks = self._blocks.get(parent.request_id)
        if not parent_blocks or child.block_ids:
            return 0
        skip = min(parent_computed, child.num_prompt_tokens - 1)
        n_blocks = min(self.blocks_needed(skip), len(parent_blocks))
        if n_blocks == 0:
            return 0
        shared = parent_blocks[:n_blocks]
        if self.sliding_window is not None and None in shared[
                max(skip - self.sliding_window + 1, 0) // self.block_size:]:
            return 0  # the parent already gave back blocks the child's window needs
        self.pool.touch([b for b in shared if b is not None])
        self._blocks[child.request_id] = list(shared)
        child.block_ids = [b.block_id for b in shared]
        child.num_computed_tokens = skip
        child.num_cached_tokens = skip
        return skip

    def free(self, request: Request) -> None:
        """Drop the request's references; its blocks return to the pool at refcount 0
        (still findable by hash when caching is on)."""
        self._cache_full_blocks(request)
        blocks = self._blocks.pop(request.request_id, [])
        self._num_registered.pop(request.request_id, None)
        self.pool.release([b for b in reversed(blocks) if b is not None])
        request.block_ids = []

    def ref_counts(self) -> list[int]:
        """Reference count of every block (tests and leak checks)."""
        return [b.ref_cnt for b in self.pool.blocks]
