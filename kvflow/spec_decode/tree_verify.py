"""Verification of candidate trees (Medusa) in pure torch, without host syncs.

A request verifying m tree nodes has m + 1 sample rows: row 0 scores the position after
its last known token (the tree's root), row 1 + n the position after node n. Node n is
*right* when its token is what the target would emit after its parent:

- temperature 0: the target's argmax at the parent's row (after bans and penalties, as
  ``Sampler`` picks). The right nodes then form one chain, and the emitted tokens are
  exactly plain greedy decoding's;
- temperature > 0, ``exact`` (the default): every row draws one token from the target's
  processed distribution (temperature, top-k/top-p/min-p, penalties) with the request's
  generator, and node n is right when it holds the token drawn at its parent's row. So
  the path follows the target's own draws: at each node the target samples, the path
  goes on into the child holding that token, and stops with the draw when no child
  holds it. Every emitted token is a draw from the target's distribution given the
  tokens before it, which is the chain's rejection sampling with one-hot drafts
  (accept with probability p(draft), else draw from the rest) spread over siblings.
  Siblings holding the same token would let two independent draws below them compete
  for the deeper path, so only the first of them counts;
- temperature > 0, ``typical`` (Medusa paper, section 2.3.1): the target's probability
  of the token at the parent's row, after the request's temperature, top-k/top-p/min-p,
  exceeds ``min(posterior_threshold, posterior_alpha * exp(-entropy))``. This keeps
  plausible continuations rather than reproducing the target's distribution.

A node is accepted when it and all its ancestors are right. The request keeps the
deepest accepted node's path (ties, possible with greedy or typical acceptance: the
likelier path), then one more token from that node's row: its argmax, or its draw from
the target's processed distribution.

The outputs are laid out like the chain verifier's: request b's emitted tokens in its
first rows (``INVALID_TOKEN`` after), plus ``perm``, the row that produced each emitted
token, so logprobs and the next drafts' hidden states are read from the right rows,
and the source/destination slots that move the accepted path's K/V next to the root.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvflow.layers.rejection_sampler import (INVALID_TOKEN, expand_metadata, processed_argmax,
                                             target_probs)
from kvflow.layers.sampler import SamplingMetadata, random_sample
from kvflow.spec_decode.tree import DraftTree
from kvflow.worker.transfer import to_device


@dataclass
class TreeVerifyOutput:
    row_token_ids: torch.Tensor  # [N] emitted tokens, request-major, INVALID_TOKEN after
    perm: torch.Tensor  # [N] int64: the sample row each emitted token was scored at
    num_accepted: torch.Tensor  # [B] int64: depth of the kept path
    src_rows: torch.Tensor  # [B * (Dmax + 1)] sample rows whose K/V to move ...
    dst_rows: torch.Tensor  # ... to these sample rows (equal where nothing moves)


@dataclass
class _Plan:
    """Host-side index maps of one step's trees (depend only on the node counts)."""

    node_rows: torch.Tensor  # [D] sample row of each node
    parent_rows: torch.Tensor  # [D] sample row of each node's parent (root or node)
    depth: torch.Tensor  # [N] float32 depth of each row's node (roots 0)
    pad_rows: torch.Tensor  # [B, M + 1] rows of each request (its last row repeated)
    pad_ok: torch.Tensor  # [B, M + 1] bool: a real row
    path_rows: torch.Tensor  # [B, M + 1, Dmax + 1] row at each depth of the row's path
    first_rows: torch.Tensor  # [B, Dmax + 1] request b's rows 0..Dmax (clamped to its own)
    twins: torch.Tensor  # [P] node (draft index) with an earlier sibling ...
    elder: torch.Tensor  # [P] ... and that sibling: a pair per earlier sibling
    row_drafts: list  # per request, per row: local draft indices preceding it
    max_depth: int


class TreeVerifier:
    def __init__(self, tree: DraftTree, posterior_threshold: float = 0.09,
                 posterior_alpha: float = 0.3, acceptance: str = "exact") -> None:
        if acceptance not in ("exact", "typical"):
            raise ValueError(f"tree acceptance must be exact or typical, got {acceptance!r}")
        self.tree = tree
        self.acceptance = acceptance
        self.threshold = posterior_threshold
        self.alpha = posterior_alpha
        self._plans: dict[tuple[tuple[int, ...], str], _Plan] = {}
        # BENCH ONLY (kvflow bench spec-verify): every node counts as right, so the
        # deepest (likeliest) path is kept each step; a cost measurement, not decoding.
        self.accept_all = False

    def _plan(self, num_draft: list[int], device: torch.device) -> _Plan:
        key = (tuple(num_draft), str(device))
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        tree = self.tree
        b = len(num_draft)
        m_max = max(num_draft)
        d_max = int(tree.depth[:m_max].max()) if m_max else 0
        node_rows, parent_rows, depth = [], [], []
        pad_rows = np.zeros((b, m_max + 1), np.int64)
        pad_ok = np.zeros((b, m_max + 1), bool)
        path_rows = np.zeros((b, m_max + 1, d_max + 1), np.int64)
        first_rows = np.zeros((b, d_max + 1), np.int64)
        row_drafts = []
        twins, elder = [], []
        start = 0
        first_node = 0  # draft index of request i's node 0
        for i, m in enumerate(num_draft):
            for n in range(m):
                for s in range(n):
                    if tree.parents[s] == tree.parents[n]:
                        twins.append(first_node + n)
                        elder.append(first_node + s)
            first_node += m
            depth.append(0.0)
            drafts_of_row = [()]
            for n in range(m):
                node_rows.append(start + 1 + n)
                par = int(tree.parents[n])
                parent_rows.append(start + (0 if par < 0 else 1 + par))
                depth.append(float(tree.depth[n]))
                drafts_of_row.append(tree.ancestors[n])  # the row after node n
            row_drafts.append(drafts_of_row)
            pad_rows[i] = start + np.minimum(np.arange(m_max + 1), m)
            pad_ok[i, : m + 1] = True
            path_rows[i] = start  # the root at depth 0 (and past a row's own depth)
            for n in range(m):
                anc = tree.ancestors[n]
                path_rows[i, 1 + n, 1: len(anc) + 1] = [start + 1 + a for a in anc]
                path_rows[i, 1 + n, len(anc) + 1:] = start + 1 + n
            first_rows[i] = start + np.minimum(np.arange(d_max + 1), m)
            start += m + 1
        plan = _Plan(
            node_rows=to_device(node_rows, device, torch.int64),
            parent_rows=to_device(parent_rows, device, torch.int64),
            depth=to_device(depth, device, torch.float32),
            pad_rows=to_device(pad_rows, device, torch.int64),
            pad_ok=to_device(pad_ok, device, torch.bool),
            path_rows=to_device(path_rows, device, torch.int64),
            first_rows=to_device(first_rows, device, torch.int64),
            twins=to_device(twins, device, torch.int64),
            elder=to_device(elder, device, torch.int64),
            row_drafts=row_drafts, max_depth=d_max)
        if len(self._plans) > 256:  # node counts vary with cuts near max_tokens
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def __call__(self, logits: torch.Tensor, draft_token_ids: torch.Tensor,
                 num_draft: list[int], meta: SamplingMetadata,
                 min_tokens_left: list[int] | None = None) -> TreeVerifyOutput:
        """logits [N, V] float32 (N = sum(m_i + 1), request-major), draft_token_ids [D]
        (each request's nodes in tree order), meta with one row per request."""
        dev = logits.device
        n_rows = logits.shape[0]
        b = len(num_draft)
        plan = self._plan(num_draft, dev)
        rmeta = expand_metadata(meta, num_draft, draft_token_ids, min_tokens_left,
                                row_drafts=plan.row_drafts)
        greedy = processed_argmax(logits, rmeta)  # [N]
        right = greedy[plan.parent_rows] == draft_token_ids  # [D]
        row_tok = greedy
        # Path score for ties between equally deep accepted nodes: the path's log-prob.
        node_lp = torch.zeros(len(draft_token_ids), device=dev)
        if not meta.all_greedy:
            p = target_probs(logits, rmeta)  # [N, V]
            p_tok = p[plan.parent_rows, draft_token_ids]  # [D]
            is_random = rmeta.temperature > 0  # [N]
            node_lp = p_tok.clamp(min=1e-30).log().clamp(min=-100.0)
            # One draw per row from the processed distribution; a seeded request's rows
            # from its own generator.
            gens, start = {}, 0
            for i, m in enumerate(num_draft):
                g = meta.generators.get(i)
                if g is not None:
                    gens.update((r, g) for r in range(start, start + m + 1))
                start += m + 1
            row_tok = torch.where(is_random, random_sample(p, gens), greedy)
            random_node = is_random[plan.node_rows]  # [D]
            if self.acceptance == "exact":
                drawn = row_tok[plan.parent_rows] == draft_token_ids
                # Of siblings holding one token, only the first may follow the draw.
                clash = (draft_token_ids[plan.twins] == draft_token_ids[plan.elder]).long()
                shadowed = torch.zeros_like(right, dtype=torch.long).index_add_(
                    0, plan.twins, clash) > 0
                right = torch.where(random_node, drawn & ~shadowed, right)
            else:
                entropy = -(p * p.clamp(min=1e-20).log()).sum(dim=-1)  # [N]
                limit = torch.clamp(self.alpha * torch.exp(-entropy), max=self.threshold)
                right = torch.where(random_node, p_tok > limit[plan.parent_rows], right)
        if self.accept_all:
            right = torch.ones_like(right)
        # Accepted: right with every ancestor right (one pass per tree level).
        ok = torch.ones(n_rows, dtype=torch.bool, device=dev)
        cum = torch.zeros(n_rows, device=dev)
        for _ in range(plan.max_depth):
            ok = ok.index_put((plan.node_rows,), right & ok[plan.parent_rows])
            cum = cum.index_put((plan.node_rows,), node_lp + cum[plan.parent_rows])
        score = torch.where(ok, plan.depth * 1e4 + cum, float("-inf"))  # [N]
        pad_score = torch.where(plan.pad_ok, score[plan.pad_rows], float("-inf"))  # [B, M+1]
        best = pad_score.argmax(dim=1)  # [B] column of the kept node (0: the root)
        best_row = plan.pad_rows.gather(1, best[:, None]).squeeze(1)  # [B]
        num_accepted = plan.depth[best_row].long()  # [B]
        path = plan.path_rows[torch.arange(b, device=dev), best]  # [B, Dmax + 1]
        cols = torch.arange(plan.max_depth + 1, device=dev)[None, :]
        kept = cols <= num_accepted[:, None]  # [B, Dmax + 1]
        # Emitted: the path's nodes' tokens, then the bonus token at the kept node's row.
        row_draft = torch.full((n_rows,), INVALID_TOKEN, dtype=torch.int64, device=dev)
        row_draft[plan.node_rows] = draft_token_ids
        tokens = row_draft[path[:, 1:]] if plan.max_depth else path[:, :0]
        tokens = torch.cat((tokens, tokens.new_full((b, 1), INVALID_TOKEN)), dim=1)
        tokens = tokens.scatter(1, num_accepted[:, None], row_tok[best_row][:, None])
        tokens = torch.where(kept, tokens, INVALID_TOKEN)  # [B, Dmax + 1]
        first = plan.first_rows  # [B, Dmax + 1]
        # Rows a request does not have (fewer nodes than Dmax) repeat its last row; they
        # are never kept (the path is no deeper than its nodes). Entries not kept go to a
        # spare last row (boolean-mask indexing would sync the host with the GPU).
        row_tokens = torch.full((n_rows + 1,), INVALID_TOKEN, dtype=torch.int64, device=dev)
        perm = torch.arange(n_rows + 1, device=dev)
        dst = torch.where(kept, first, n_rows).reshape(-1)
        row_tokens[dst] = tokens.reshape(-1)
        perm[dst] = path.reshape(-1)
        row_tokens, perm = row_tokens[:n_rows], perm[:n_rows]
        # K/V of the kept nodes move from their tree slots to the slots right after the
        # root (depth d -> the request's row d); everything else stays (src = dst).
        src = torch.where(kept, path, first)
        return TreeVerifyOutput(row_token_ids=row_tokens, perm=perm,
                                num_accepted=num_accepted, src_rows=src.reshape(-1),
                                dst_rows=first.reshape(-1))


def move_kv(kv_caches: torch.Tensor, kv_scales: torch.Tensor | None, src_slots: torch.Tensor,
            dst_slots: torch.Tensor) -> None:
    """Copy K/V (and an int8 cache's scales) of flat slots ``src_slots`` [P] to
    ``dst_slots`` [P] in every layer: kv_caches [L, 2, NB, BS, KVH, D]. The source rows
    are gathered before anything is written, so overlapping moves are safe."""
    caches = kv_caches.view(torch.uint8) if kv_caches.element_size() == 1 \
        and kv_caches.dtype != torch.int8 else kv_caches
    l, two, nb, bs = caches.shape[:4]
    flats = [caches.view(l, two, nb * bs, *caches.shape[4:])]
    if kv_scales is not None:
        flats.append(kv_scales.view(l, two, nb * bs, *kv_scales.shape[4:]))
    if caches.device.type == "cpu":
        # The host has the slots for free here; index ops along the slot dimension of a
        # whole cache measured 30 ms on two cores (they walk far more than the few
        # rows moved), so copy just the moved slots, a handful per request.
        pairs = [(s, d) for s, d in zip(src_slots.tolist(), dst_slots.tolist()) if s != d]
        for flat in flats:
            rows = [flat[:, :, s].clone() for s, _ in pairs]  # all sources first
            for (_, d), row in zip(pairs, rows):
                flat[:, :, d].copy_(row)
        return
    for flat in flats:  # GPU: one gather and one scatter, no host sync
        flat[:, :, dst_slots] = flat[:, :, src_slots]
