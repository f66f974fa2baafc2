"""``eagle_mlp``: a feature-level draft head in the style of EAGLE (Li et al. 2024), with
an MLP body and a reduced draft vocabulary, drafting autoregressively.

Medusa head i guesses the token i + 2 places ahead from the target's last hidden state
alone; it never learns which token the target actually emitted next, and on a small
model that costs most of its accuracy (SmolLM2-135M: 14.6% top-1 for head 0). This head
is given both: from the target's final hidden state f_t at the row that emitted token
x_{t+1}, and the embedding of x_{t+1}, it predicts the target's next hidden state

    f'_{t+1} = norm_out(z + MLP(norm(z))),  z = fc([f_t, norm_e(embed(x_{t+1}))])

and reads the draft x_{t+2} off it through the rows of the target's own lm_head for the
``draft_vocab_size`` most frequent answer tokens (argmax over those rows). The next step
feeds (f'_{t+1}, x_{t+2}) back in: k drafts cost k passes of a block of ~2M weights plus
the draft vocabulary's rows, no attention and no KV cache (the context reaches the head
only through f_t, so a request needs no state here at all).

EAGLE's draft is a full decoder layer with attention over the draft's own KV; this one
drops the attention, which keeps the proposer stateless and cheap on CPU, at the price of
some accuracy on later drafts (measured in ``kvflow train-eagle``'s report).

Verification is the chain's exact rejection sampling with the one-hot rule (drafts are
argmax picks, no draft distribution), so greedy output equals plain greedy decoding and
sampled output is the target's distribution.

Checkpoint: a directory with ``config.json`` (``kvflow_draft_head: "eagle_mlp"``, sizes,
and the training report) and ``eagle_mlp.safetensors`` (the block's weights and the
draft vocabulary's token ids). The draft vocabulary's lm_head rows and the token
embeddings are the target's own, read at load time: the checkpoint holds no copy of them.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from torch import nn

from kvflow.errors import InvalidParameterError, ModelLoadError
from kvflow.spec_decode.heads_config import EAGLE_MLP_FILE, EagleMlpConfig
from kvflow.spec_decode.proposer import Proposer


class _RMSNorm(nn.Module):
    """Plain RMS norm with a learned scale (the head's own; the target's norms are not
    reused because its features arrive already normalized)."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class EagleMlpHead(nn.Module):
    """The draft block: (feature [N, H], token embedding [N, H]) -> next feature [N, H]."""

    def __init__(self, cfg: EagleMlpConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.cfg = cfg
        self.embed_norm = _RMSNorm(h, cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h)
        self.mlp_norm = _RMSNorm(h, cfg.rms_norm_eps)
        self.gate_up = nn.Linear(h, 2 * i, bias=False)
        self.down = nn.Linear(i, h, bias=False)
        self.out_norm = _RMSNorm(h, cfg.rms_norm_eps)
        # Token ids of the draft vocabulary (a buffer: saved and moved with the head).
        self.register_buffer("vocab", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))

    def forward(self, feature: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        z = self.fc(torch.cat([feature, self.embed_norm(embedding)], dim=-1))  # [N, H]
        gate, up = self.gate_up(self.mlp_norm(z)).chunk(2, dim=-1)  # [N, I] each
        z = z + self.down(nn.functional.silu(gate) * up)
        return self.out_norm(z)  # [N, H], in the scale of the target's final features

    def save(self, path: str, extra: dict | None = None) -> None:
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(tensors, os.path.join(path, EAGLE_MLP_FILE))
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump({**self.cfg.to_json(), **(extra or {})}, f, indent=2)

    @classmethod
    def load(cls, path: str, dtype: torch.dtype, device: torch.device) -> "EagleMlpHead":
        from safetensors.torch import load_file

        cfg = EagleMlpConfig.read(path)
        head = cls(cfg)
        tensors = load_file(os.path.join(path, EAGLE_MLP_FILE))
        want = head.state_dict()
        missing = sorted(set(want) - set(tensors))
        if missing:
            raise ModelLoadError(f"speculative_config.model: {path}/{EAGLE_MLP_FILE} lacks "
                                 f"{', '.join(missing[:4])}", param="speculative_config.model")
        for name, p in want.items():
            if tensors[name].shape != p.shape:
                raise InvalidParameterError(
                    f"speculative_config.model: {name} has shape {tuple(tensors[name].shape)}"
                    f", its config.json says {tuple(p.shape)}", param="speculative_config.model")
        head.load_state_dict(tensors)
        vocab = head.vocab
        if int(vocab.min()) < 0 or int(vocab.max()) >= cfg.vocab_size:
            raise InvalidParameterError("speculative_config.model: the draft vocabulary has "
                                        f"token ids outside [0, {cfg.vocab_size})",
                                        param="speculative_config.model")
        head = head.to(device=device)
        for name, p in head.named_parameters():  # the buffer of ids stays int64
            p.data = p.data.to(dtype)
        return head.eval()


def target_lm_head_rows(target: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the target's output projection as a dense [len(ids), H] matrix,
    whatever its storage (4-bit, tied, ...): lm_head(I) = W^T, read through the layer."""
    hidden = target.config.hidden_size
    eye = torch.eye(hidden, dtype=torch.float32, device=ids.device)
    with torch.inference_mode():
        w = target.compute_logits(eye)  # [H, V]
    return w[:, ids].t().contiguous()  # [Vd, H]


class EagleMlpProposer(Proposer):
    """Drafts k tokens per request from the target's hidden state at its last token."""

    wants_hidden = True

    # How ``min_confidence`` gates a chain: "per_draft" stops before the first draft whose
    # own probability under the head is below it; "cumulative" before the first whose
    # chain probability (the product of the probabilities up to it: the head's estimate
    # that the draft is kept, which is what a verified row is worth) is.
    RULES = ("per_draft", "cumulative")

    def __init__(self, path: str, num_speculative_tokens: int, target: nn.Module,
                 dtype: torch.dtype, device: torch.device, min_confidence: float = 0.0,
                 rule: str = "per_draft") -> None:
        arch = target.config
        if rule not in self.RULES:
            raise InvalidParameterError(f"eagle_mlp confidence rule must be one of "
                                        f"{', '.join(self.RULES)}, got {rule!r}",
                                        param="speculative_config.draft_confidence")
        self.min_confidence = min_confidence
        self.rule = rule
        self.num_speculative_tokens = num_speculative_tokens
        cfg = EagleMlpConfig.read(path)
        cfg.check(arch.hidden_size, arch.vocab_size)
        self.head = EagleMlpHead.load(path, dtype, device)
        self.vocab = self.head.vocab  # [Vd] int64
        self.lm_rows = target_lm_head_rows(target, self.vocab).to(dtype)  # [Vd, H]
        self.embed = target.model.embed_tokens  # ids [N] -> [N, H]
        self.device = device

    @torch.inference_mode()
    def draft(self, hidden: torch.Tensor, last: torch.Tensor, k: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [R, H], last token ids [R] -> drafts [R, n] (greedy over the draft
        vocabulary; n = k, or fewer once every row's chain has ended) and how many of them
        to propose [R] (all, or fewer where a draft's probability under the head falls
        below ``min_confidence``)."""
        feature, token, out, probs = hidden, last, [], []
        alive = torch.ones(len(hidden), dtype=torch.bool, device=hidden.device)
        chain = torch.ones(len(hidden), device=hidden.device)
        for _ in range(k):
            feature = self.head(feature, self.embed(token).to(feature.dtype))  # [R, H]
            logits = feature @ self.lm_rows.t()  # [R, Vd]
            if self.min_confidence > 0:
                best, pick = logits.float().softmax(dim=-1).max(dim=-1)  # [R] each
                if self.rule == "cumulative":
                    best = chain = chain * best
                probs.append(best)
                alive &= best >= self.min_confidence
            else:
                pick = logits.argmax(dim=-1)
            token = self.vocab[pick]  # [R]
            out.append(token)
            # Every chain has ended: the later drafts would all be cut (a draft step
            # costs ~10-20% of a CPU decode step, so gated steps must not pay for them).
            if probs and not bool(alive.any()):
                break
        n = len(out)
        drafts = torch.stack(out, dim=1)  # [R, n]
        if not probs:
            return drafts, torch.full((len(drafts),), n, dtype=torch.int64)
        sure = torch.stack(probs, dim=1) >= self.min_confidence  # [R, n]
        return drafts, sure.long().cumprod(dim=1).sum(dim=1)

    def propose(self, token_ids: list[np.ndarray], max_drafts: list[int],
                req_ids: list[str] | None = None, params=None,
                hidden: torch.Tensor | None = None) -> list[list[int]]:
        """``hidden`` [R, H]: each request's hidden state at the row that emitted its last
        token, ``token_ids[i][-1]``."""
        if hidden is None or not len(token_ids):
            return [[] for _ in token_ids]
        k = min(self.num_speculative_tokens, max(max_drafts))
        if k <= 0:
            return [[] for _ in token_ids]
        last = torch.as_tensor(np.array([int(t[-1]) for t in token_ids]), dtype=torch.int64,
                               device=hidden.device)
        drafts, keep = self.draft(hidden, last, k)
        return [row[: min(m, n)] for row, m, n in zip(drafts.tolist(), max_drafts,
                                                      keep.tolist())]


__all__ = ["EagleMlpHead", "EagleMlpProposer", "target_lm_head_rows"]
