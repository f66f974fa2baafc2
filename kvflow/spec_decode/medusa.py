"""Medusa heads (Cai et al. 2024): small heads on the target's last hidden state, head i
guessing the token i + 2 places ahead (the base lm_head gives the next one).

Each head is ``num_layers`` residual blocks ``x + SiLU(W x + b)`` followed by a vocabulary
projection: its own (public Medusa checkpoints) or the base model's lm_head (the heads
``kvflow train-medusa`` writes, a few hundred thousand parameters each).

Checkpoint layout, shared with the public Medusa repositories: a directory with
``config.json`` (``medusa_num_heads``, ``medusa_num_layers``; kvflow adds
``hidden_size``, ``vocab_size`` and ``shared_lm_head``) and ``medusa_lm_head.safetensors``
with tensors ``{i}.{j}.linear.weight`` / ``.bias`` (block j of head i) and, for own
projections, ``{i}.{num_layers}.weight``.

Verification: a static candidate tree of the heads' top-k guesses (spec_decode/tree.py),
checked in one step with tree attention (spec_decode/tree_verify.py); or, with
``medusa_tree: "chain"``, each head's top-1 token as a chain of drafts (exact rejection
sampling, one-hot rule, at any temperature). See docs/speculative.md.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from torch import nn

from kvflow.errors import InvalidParameterError, ModelLoadError
from kvflow.layers.sampler import greedy_argmax
from kvflow.spec_decode.heads_config import HEADS_FILE, MedusaHeadsConfig
from kvflow.spec_decode.proposer import Proposer


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # starts as the identity: the base's own guess

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """``num_heads`` heads; ``forward`` gives every head's logits for hidden states."""

    def __init__(self, cfg: MedusaHeadsConfig, hidden: int, vocab: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.heads = nn.ModuleList()
        for _ in range(cfg.num_heads):
            layers: list[nn.Module] = [ResBlock(hidden) for _ in range(cfg.num_layers)]
            if not cfg.shared_lm_head:
                layers.append(nn.Linear(hidden, vocab, bias=False))
            self.heads.append(nn.Sequential(*layers))

    def hidden(self, x: torch.Tensor, num: int | None = None) -> torch.Tensor:
        """x [N, H] -> the first ``num`` (default all) heads' hidden states before their
        projection [num, N, H]."""
        if not self.cfg.shared_lm_head:
            raise RuntimeError("heads with their own projection give logits, not hidden")
        return torch.stack([head(x) for head in self.heads[:num]])

    def logits(self, x: torch.Tensor, base_lm_head, num: int | None = None) -> torch.Tensor:
        """x [N, H] -> [num, N, V] float32 of the first ``num`` heads (default all);
        ``base_lm_head`` maps [M, H] -> [M, V]. (A head's vocabulary projection is most
        of its cost: heads a proposal does not use are not run.)"""
        if self.cfg.shared_lm_head:
            h = self.hidden(x, num)  # [num, N, H]
            return base_lm_head(h.reshape(-1, h.shape[-1])).float().view(
                h.shape[0], h.shape[1], -1)
        return torch.stack([head(x).float() for head in self.heads[:num]])

    def save(self, path: str, extra: dict | None = None) -> None:
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        tensors = {name.removeprefix("heads."): t.detach().contiguous().cpu()
                   for name, t in self.state_dict().items()}
        save_file(tensors, os.path.join(path, HEADS_FILE))
        cfg = {"medusa_num_heads": self.cfg.num_heads, "medusa_num_layers": self.cfg.num_layers,
               "hidden_size": self.cfg.hidden_size, "vocab_size": self.cfg.vocab_size,
               "shared_lm_head": self.cfg.shared_lm_head, **(extra or {})}
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2)

    @classmethod
    def load(cls, path: str, hidden: int, vocab: int, dtype: torch.dtype,
             device: torch.device) -> "MedusaHeads":
        from safetensors.torch import load_file

        cfg = MedusaHeadsConfig.read(path)
        heads = cls(cfg, hidden, vocab)
        tensors = load_file(os.path.join(path, HEADS_FILE))
        # Some exports prefix the names (medusa_head.0.0.linear.weight).
        tensors = {k.removeprefix("medusa_head."): v for k, v in tensors.items()}
        want = {name.removeprefix("heads."): p for name, p in heads.state_dict().items()}
        missing = sorted(set(want) - set(tensors))
        if missing:
            raise ModelLoadError(f"speculative_config.model: {path}/{HEADS_FILE} lacks "
                                 f"{', '.join(missing[:4])}", param="speculative_config.model")
        for name, p in want.items():
            t = tensors[name]
            if t.shape != p.shape:
                raise InvalidParameterError(
                    f"speculative_config.model: {name} has shape {tuple(t.shape)}, the "
                    f"target needs {tuple(p.shape)} (heads for another model?)",
                    param="speculative_config.model")
            p.copy_(t)
        return heads.to(device=device, dtype=dtype).eval()


class MedusaProposer(Proposer):
    """Drafts from the heads on the hidden state that gave each request's last token."""

    wants_hidden = True

    def __init__(self, path: str, num_speculative_tokens: int, target: nn.Module,
                 dtype: torch.dtype, device: torch.device, tree_option=None) -> None:
        from kvflow.spec_decode.tree import parse_tree_option

        arch = target.config
        self.num_speculative_tokens = num_speculative_tokens
        self.heads = MedusaHeads.load(path, arch.hidden_size, arch.vocab_size, dtype, device)
        self.heads.cfg.check(arch.hidden_size, arch.vocab_size, num_speculative_tokens)
        self.lm_head = target.compute_logits  # [M, H] -> [M, V] float32
        # The candidate tree (None: a chain of top-1 guesses, verified exactly).
        self.tree = parse_tree_option(tree_option, self.heads.cfg.num_heads, device.type,
                                      MedusaHeadsConfig.read_report(path),
                                      num_speculative_tokens)
        if self.tree is not None:
            t = self.tree
            self._node_head = torch.as_tensor(t.depth - 1, device=device)  # [N]
            self._node_rank = torch.as_tensor(t.rank, device=device)  # [N]

    def propose(self, token_ids: list[np.ndarray], max_drafts: list[int],
                req_ids: list[str] | None = None, params=None,
                hidden: torch.Tensor | None = None) -> list[list[int]]:
        """``hidden`` [R, H]: each request's hidden state at its last emitted token's row."""
        if hidden is None or not len(token_ids):
            return [[] for _ in token_ids]
        if self.tree is not None:  # every node: its head's guess of its rank
            t = self.tree
            logits = self.heads.logits(hidden, self.lm_head, t.max_depth)  # [d, R, V]
            top = logits.topk(t.max_rank, dim=-1).indices  # [d, R, ranks]
            nodes = top[self._node_head, :, self._node_rank].t().tolist()  # [R, N]
            return [row if m else [] for row, m in zip(nodes, max_drafts)]
        k = self.num_speculative_tokens
        logits = self.heads.logits(hidden, self.lm_head, k)  # [k, R, V]
        top = greedy_argmax(logits.reshape(-1, logits.shape[-1])).view(
            logits.shape[:-1]).t().tolist()  # [R, k]
        return [row[: min(m, k)] for row, m in zip(top, max_drafts)]
