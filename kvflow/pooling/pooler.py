"""The worker's side of pooling: which rows of a step feed which pooling request, and the
reduction of those rows' final hidden states (after the model's final norm).

A pooling request's prompt may be prefilled over several steps (chunked prefill). Last
token and score requests read one row, in the step that computes the last prompt token.
Mean pooling keeps a running float32 sum per request on the device, added to by every
chunk; CLS keeps the first token's row. A request preempted by recompute comes back with
no computed tokens and starts a fresh sum; one swapped back in keeps its sum (the tokens
it resumes after were summed). The scheduler never lets mean/CLS requests skip tokens
through the prefix cache (``PoolingParams.needs_all_tokens``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvflow.pooling.params import PoolingParams
from kvflow.worker.transfer import to_host_async


@dataclass
class _PoolState:
    params: PoolingParams
    num_prompt_tokens: int
    acc: torch.Tensor | None = None  # [H] float32: mean's running sum, or CLS's row


@dataclass
class PoolingPlan:
    """One step's pooling work (flat token indices into the step's hidden states)."""

    chunks: list[tuple[str, int, int]] = field(default_factory=list)  # mean: rows a:b
    first_rows: list[tuple[str, int]] = field(default_factory=list)  # CLS rows
    finishing: list[tuple[str, int]] = field(default_factory=list)  # (req, last row)


@dataclass
class PooledHost:
    """Host copies of the vectors of the requests a step finished."""

    req_ids: list[str]
    vectors: list[torch.Tensor]  # one [D] float32 per request


class PoolingTracker:
    """Per-request pooling state of the worker (owned by the StepBuilder)."""

    def __init__(self) -> None:
        self.reqs: dict[str, _PoolState] = {}

    def add(self, req_id: str, params: PoolingParams, num_prompt_tokens: int,
            num_computed_tokens: int) -> None:
        """A request (re)joins the batch; from scratch unless it resumes a swap."""
        state = self.reqs.get(req_id)
        if state is None or num_computed_tokens == 0:
            self.reqs[req_id] = _PoolState(params, num_prompt_tokens)

    def drop(self, req_id: str) -> None:
        self.reqs.pop(req_id, None)

    def is_pooling(self, req_ids: list[str]) -> np.ndarray:
        """[R] bool: which of the step's requests pool (they never sample)."""
        return np.fromiter((r in self.reqs for r in req_ids), dtype=bool, count=len(req_ids))

    def plan(self, req_ids: list[str], nc: np.ndarray, n: np.ndarray,
             qsl: np.ndarray) -> PoolingPlan | None:
        """The step's pooling rows: request ``i`` computes positions nc[i]:nc[i] + n[i] at
        flat rows qsl[i]:qsl[i + 1]."""
        plan = PoolingPlan()
        for i, rid in enumerate(req_ids):
            state = self.reqs.get(rid)
            if state is None:
                continue
            start, end = int(qsl[i]), int(qsl[i + 1])
            p = state.params
            if p.score_token_ids is None and p.pooling_type == "mean":
                plan.chunks.append((rid, start, end))
            elif p.score_token_ids is None and p.pooling_type == "cls" and int(nc[i]) == 0:
                plan.first_rows.append((rid, start))
            if int(nc[i] + n[i]) >= state.num_prompt_tokens:
                plan.finishing.append((rid, end - 1))
        if not (plan.chunks or plan.first_rows or plan.finishing):
            return None
        return plan

    def run(self, plan: PoolingPlan, hidden: torch.Tensor,
            compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> PooledHost | None:
        """Reduce this step's rows (``hidden`` [T, H], on the device) and start the host
        copies of the finished requests' vectors."""
        for rid, a, b in plan.chunks:
            state = self.reqs[rid]
            part = hidden[a:b].float().sum(dim=0)  # [H]
            state.acc = part if state.acc is None else state.acc + part
        for rid, row in plan.first_rows:
            self.reqs[rid].acc = hidden[row].to(torch.float32, copy=True)  # [H]
        if not plan.finishing:
            return None
        ids, vectors = [], []
        for rid, row in plan.finishing:
            state = self.reqs[rid]
            p = state.params
            if p.score_token_ids is not None:
                logits = compute_logits(hidden[row:row + 1])  # [1, V] float32
                vec = logits[0, torch.tensor(p.score_token_ids, device=logits.device)]
            else:
                if p.pooling_type == "last":
                    vec = hidden[row].to(torch.float32, copy=True)  # [H]
                elif p.pooling_type == "mean":
                    vec = state.acc / state.num_prompt_tokens
                else:
                    vec = state.acc
                if p.dimensions is not None:
                    vec = vec[: p.dimensions]
                if p.normalize:
                    vec = torch.nn.functional.normalize(vec, dim=0)
            ids.append(rid)
            vectors.append(to_host_async(vec.contiguous()))
        return PooledHost(ids, vectors)

    @staticmethod
    def collect(host: PooledHost | None) -> dict[str, list[float]]:
        """The finished vectors as plain lists (the step's event has fired)."""
        if host is None:
            return {}
        return {rid: v.tolist() for rid, v in zip(host.req_ids, host.vectors)}
