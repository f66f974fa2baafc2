"""The typed pieces of one worker step: its inputs, which positions it samples, the
tokens still in flight from the step before, and the host copies of its outputs.

``StepBuilder`` (step_builder.py) makes and consumes all of them; the runner, the CUDA
graph runner and the sampler only read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvflow.layers.attention import AttentionMetadata
from kvflow.pooling.pooler import PooledHost, PoolingPlan

# Token id marking a sampled token whose value is still on the device (overlapped steps).
PLACEHOLDER = -1


@dataclass
class SamplePlan:
    """Which positions of the step are sampled, per request (a ragged list).

    Without drafts each sampling request samples one position, its last; a request
    verifying k draft tokens would sample k + 1. Sample rows are flat: request
    ``req_indices[j]`` owns rows ``offsets[j]:offsets[j + 1]``.
    """

    req_indices: np.ndarray  # [S] indices into StepInputs.req_ids
    offsets: np.ndarray  # [S + 1] int64 cumulative sample rows
    logits_indices: torch.Tensor  # [N] flat token index whose hidden state gives logits
    # Speculative decoding (None when no request of the step has drafts): drafts per
    # sampling request [S] and their token ids, flat [N - S]; the rows are verified by
    # rejection sampling, and a request keeps 1 to d + 1 of them.
    num_draft: list[int] | None = None
    draft_token_ids: list[int] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.req_indices)

    @property
    def num_rows(self) -> int:
        return int(self.offsets[-1])

    def counts(self) -> np.ndarray:
        """[S] sample rows per sampling request."""
        return np.diff(self.offsets)


@dataclass
class PromptLogprobsSpan:
    req_id: str
    start: int  # rows start:end of PromptLogprobsPlan.indices belong to this request
    end: int
    num_logprobs: int


@dataclass
class PromptLogprobsPlan:
    """Positions of this step's prompt chunks that still owe prompt logprobs."""

    indices: list[int] = field(default_factory=list)  # flat token indices
    targets: list[int] = field(default_factory=list)  # the prompt token each one scores
    spans: list[PromptLogprobsSpan] = field(default_factory=list)


@dataclass
class StepInputs:
    """The tensors and bookkeeping of one step (requests in decode-first order).

    Built the same way from the same SchedulerOutput on every rank.
    """

    req_ids: list[str]
    rows: np.ndarray  # [R] batch rows
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample: SamplePlan
    prompt_logprobs: PromptLogprobsPlan
    # [P] int64 on the CPU: the tokens that are prompt tokens (None: none). The C++ CPU
    # step keeps them off int8 activations.
    prompt_rows: torch.Tensor | None = None
    pooling: PoolingPlan | None = None  # rows that pooling requests reduce (None: none)


@dataclass
class PendingTokens:
    """Tokens sampled by the last launched step whose values only the device knows yet.

    They sit in the batch's token ids as PLACEHOLDER; request ``r``'s tokens at positions
    ``first_pos .. first_pos + count - 1`` are ``token_ids[first_row ..]`` in order.
    """

    token_ids: torch.Tensor | None = None  # [N] on the device
    spans: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # (first_pos,
    # first_row, count) per request

    def source(self, req_id: str, position: int) -> int:
        """Index into ``token_ids`` of the in-flight token at ``position``."""
        span = self.spans.get(req_id)
        if span is None or not span[0] <= position < span[0] + span[2]:
            raise RuntimeError(f"request {req_id}: token {position} is unknown")
        return span[1] + position - span[0]

    def drop(self, req_id: str) -> None:
        self.spans.pop(req_id, None)


@dataclass
class SampleSlot:
    """Where one request's sampled tokens of a step go once the host has them."""

    req_index: int  # into StepInputs.req_ids
    req_id: str
    position: int  # sequence position of its first sampled token
    first_row: int  # its first row of the step's sampled tokens
    count: int
    num_logprobs: int | None
    # Verified drafts: the tokens are appended when the host has them (only a prefix of
    # the count rows is emitted), not held as placeholders.
    verified: bool = False


@dataclass
class StepHostOutputs:
    """Pinned host copies of a launched step's outputs (valid once its event fired)."""

    sampled: torch.Tensor | None = None  # [N] sampled token ids
    # (token ids [N, 1 + k], logprobs [N, 1 + k], ranks [N]) when any request asked.
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    slots: list[SampleSlot] = field(default_factory=list)
    # The sample rows' hidden states [N, H] (on the device), kept for proposers that
    # draft from them (Medusa heads); None otherwise.
    sample_hidden: torch.Tensor | None = None
    # Prompt logprobs: the plan's spans and (ids, logprobs, ranks) over its rows.
    prompt_logprobs: tuple[list[PromptLogprobsSpan],
                           tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    pooled: PooledHost | None = None  # vectors of the pooling requests the step finished
