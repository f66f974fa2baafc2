"""Static candidate trees for Medusa heads (Cai et al. 2024), torch-free.

A tree is a set of *choices*: paths of top-k ranks, one rank per head. ``(0,)`` is head
0's best guess, ``(1,)`` its second best, ``(0, 2)`` head 1's third guess following head
0's best, and so on. Every prefix of a choice is a choice too, so the set is a tree whose
root is the request's last known token.

Nodes are kept in breadth-first order (by depth, then by path), which gives two
properties the rest of the worker relies on: a node's ancestors come before it, and any
prefix of the node list is itself a tree. The scheduler may cut a request's drafts to
fewer tokens (token budget, max_tokens, max_model_len); the cut list is still a valid
tree, so a verification step needs nothing but the node count.

Layout in a verification step: the root (the last known token) and then the nodes, as
consecutive tokens of the request (cache slots in that order), with rotary positions
``root + depth``; node i may attend to the committed context, the root and its own
ancestors (``visible``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# The attention kernels carry each query's visible tree tokens as one 64-bit mask.
MAX_TREE_TOKENS = 64  # root + nodes
MAX_TREE_NODES = MAX_TREE_TOKENS - 1
MAX_TREE_RANK = 32  # top-k ranks a choice may use per head

# Default tree sizes (nodes) by device: a CPU verification step pays for every extra
# token in matmul time, a GPU batch-1 step is bound by the weight read and takes dozens
# of tokens for nearly the price of one.
DEFAULT_TREE_NODES = {"cpu": 4, "cuda": 32}


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A static tree, nodes in breadth-first order."""

    choices: tuple[tuple[int, ...], ...]  # [N] rank path of each node
    parents: np.ndarray  # [N] int64: parent node index, -1 for children of the root
    depth: np.ndarray  # [N] int64, 1..max_depth (the head of node i is depth[i] - 1)
    rank: np.ndarray  # [N] int64: top-k rank of node i within its head
    # visible[i, j]: tree token i may attend to tree token j (0 = root, 1 + n = node n):
    # its ancestors, itself and the root. [N + 1, N + 1] bool.
    visible: np.ndarray
    # ancestors[n]: node indices on the path from the root to node n, node n included.
    ancestors: tuple[tuple[int, ...], ...]

    @property
    def num_nodes(self) -> int:
        return len(self.choices)

    @property
    def max_depth(self) -> int:
        return int(self.depth.max()) if len(self.depth) else 0

    @property
    def max_rank(self) -> int:
        return int(self.rank.max()) + 1 if len(self.rank) else 0

    @classmethod
    def from_choices(cls, choices, where: str = "speculative_config.medusa_tree"
                     ) -> "DraftTree":
        """Validate and sort ``choices`` (a list of rank lists)."""
        from kvflow.errors import InvalidParameterError

        def bad(msg: str) -> InvalidParameterError:
            return InvalidParameterError(f"{where}: {msg}", param=where)

        paths = []
        for c in choices:
            if not isinstance(c, (list, tuple)) or not c or not all(
                    isinstance(r, int) and not isinstance(r, bool) and 0 <= r < MAX_TREE_RANK
                    for r in c):
                raise bad(f"each choice must be a non-empty list of top-k ranks in "
                          f"[0, {MAX_TREE_RANK}), got {c!r}")
            paths.append(tuple(c))
        if not paths:
            raise bad("needs at least one choice")
        if len(set(paths)) != len(paths):
            raise bad("has a repeated choice")
        if len(paths) > MAX_TREE_NODES:
            raise bad(f"has {len(paths)} nodes; at most {MAX_TREE_NODES} are supported")
        known = set(paths)
        for p in paths:
            if len(p) > 1 and p[:-1] not in known:
                raise bad(f"choice {list(p)} lacks its parent {list(p[:-1])}")
        paths.sort(key=lambda p: (len(p), p))
        index = {p: i for i, p in enumerate(paths)}
        n = len(paths)
        parents = np.array([index[p[:-1]] if len(p) > 1 else -1 for p in paths], np.int64)
        ancestors = []
        for i, p in enumerate(paths):
            ancestors.append(tuple(index[p[: d + 1]] for d in range(len(p))))
        visible = np.zeros((n + 1, n + 1), dtype=bool)
        visible[:, 0] = True
        for i, anc in enumerate(ancestors):
            visible[i + 1, [a + 1 for a in anc]] = True
        return cls(choices=tuple(paths), parents=parents,
                   depth=np.array([len(p) for p in paths], np.int64),
                   rank=np.array([p[-1] for p in paths], np.int64), visible=visible,
                   ancestors=tuple(ancestors))

    @classmethod
    def chain(cls, depth: int) -> "DraftTree":
        """Each head's top-1 guess after the previous one: a chain of ``depth`` drafts."""
        return cls.from_choices([[0] * d for d in range(1, depth + 1)])

    @classmethod
    def best(cls, num_nodes: int, rank_accuracy: list[list[float]]) -> "DraftTree":
        """The ``num_nodes`` paths most likely to be accepted, if head d's rank-r guess is
        right with probability ``rank_accuracy[d][r]`` independently of the others (the
        Medusa paper's construction). A path is never likelier than its prefix, so the
        chosen set is prefix-closed: a tree."""
        import heapq

        heads = len(rank_accuracy)
        num_nodes = min(num_nodes, MAX_TREE_NODES)
        # Best-first search over paths by probability.
        heap = [(-rank_accuracy[0][r], (r,)) for r in range(len(rank_accuracy[0]))]
        heapq.heapify(heap)
        chosen: list[tuple[int, ...]] = []
        while heap and len(chosen) < num_nodes:
            neg, path = heapq.heappop(heap)
            chosen.append(path)
            d = len(path)
            if d < heads:
                for r, acc in enumerate(rank_accuracy[d]):
                    heapq.heappush(heap, (neg * acc, path + (r,)))
        return cls.from_choices(chosen)


def rank_accuracy_profile(report: dict | None, num_heads: int,
                          ranks: int = 8) -> list[list[float]]:
    """Per head, the probability that its rank-r guess is the right token: measured on
    held-out text when the checkpoint records it (``kvflow train-medusa`` writes
    ``heldout[*].rank_accuracy``), else spread from its top-1 / top-5 figures, else a
    generic profile (accuracy falling with depth and rank)."""
    rows = (report or {}).get("heldout") or []
    out = []
    for d in range(num_heads):
        row = rows[d] if d < len(rows) else None
        if row and row.get("rank_accuracy"):
            acc = [max(float(a), 1e-6) for a in row["rank_accuracy"][:ranks]]
        elif row and "top1" in row:
            top1, top5 = float(row["top1"]), float(row.get("top5", row["top1"]))
            # Ranks 1..4 share top5 - top1 geometrically (ratio 0.6), later ranks decay on.
            rest = max(top5 - top1, 0.0)
            w = [0.6 ** i for i in range(4)]
            acc = [max(top1, 1e-6)] + [max(rest * x / sum(w), 1e-6) for x in w]
            while len(acc) < ranks:
                acc.append(acc[-1] * 0.6)
        else:
            base = 0.6 * 0.7 ** d
            acc = [base * 0.5 ** r for r in range(ranks)]
        out.append(acc[:ranks])
    return out


def parse_tree_option(value, num_heads: int, device_type: str, report: dict | None,
                      max_depth: int) -> DraftTree | None:
    """``speculative_config.medusa_tree`` -> the tree (None: verify a chain, exact).

    None: a tree of the device's default size; ``"chain"``: the old chain of top-1
    guesses; an int N: the best N-node tree for the heads' accuracies; a list of
    choices: that tree. Depth is capped at ``max_depth`` (num_speculative_tokens)."""
    from kvflow.errors import InvalidParameterError

    where = "speculative_config.medusa_tree"
    if value == "chain":
        return None
    depth = min(num_heads, max_depth)
    if value is None or isinstance(value, int) and not isinstance(value, bool):
        size = DEFAULT_TREE_NODES.get(device_type, DEFAULT_TREE_NODES["cpu"]) \
            if value is None else value
        if not 1 <= size <= MAX_TREE_NODES:
            raise InvalidParameterError(f"{where}: a tree size must be in [1, "
                                        f"{MAX_TREE_NODES}], got {size}", param=where)
        return DraftTree.best(size, rank_accuracy_profile(report, depth))
    tree = DraftTree.from_choices(value, where)
    if tree.max_depth > depth:
        raise InvalidParameterError(
            f"{where}: a choice is {tree.max_depth} deep but only {depth} heads are used "
            f"(num_speculative_tokens and the checkpoint's heads cap the depth)", param=where)
    return tree
