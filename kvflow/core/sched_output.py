"""Plain data passed between scheduler, worker and engine (no tensors: rule 5 of
docs/architecture.md).

SchedulerOutput is a diff: a request's full data goes to the worker once (when it is
first scheduled, or again after a preemption), afterwards only new block ids and counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.pooling.params import PoolingParams
from kvflow.lora.request import LoRARequest
from kvflow.sampling_params import SamplingParams

# Logprobs of one position: token ids (the chosen/actual token first, then the top-N),
# their logprobs, and the rank of the chosen token among the whole vocabulary (1 = top).
LogprobsEntry = tuple[list[int], list[float], int]


@dataclass
class EngineCoreRequest:
    """A tokenized, validated request for the engine core (one sample of a prompt)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # n == 1 here: samples are separate requests
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0
    fork_of: str | None = None  # id of the sibling sample whose prompt blocks to share
    cache_salt: str | None = None  # prefix-cache isolation key
    pooling: PoolingParams | None = None  # a pooling request: prefill, pool, no sampling
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base)


@dataclass
class NewRequestData:
    """Everything the worker needs to start (or resume) running a request."""

    req_id: str
    token_ids: list[int]  # prompt plus any tokens generated before a preemption
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # The request's end-of-sequence ids (Request.eos_token_ids): the scheduler stops on
    # them and the worker keeps them from being sampled under min_tokens, from one set.
    eos_token_ids: list[int] = field(default_factory=list)
    pooling: PoolingParams | None = None  # pooled when its prompt is computed, no sampling
    lora_request: LoRARequest | None = None  # the adapter its rows run with


@dataclass
class CachedRequestData:
    """What changed for a request the worker already holds."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Set when the block table was cut back to this many blocks before ``new_block_ids``
    # are appended (blocks that held only rejected draft tokens were freed).
    num_kept_blocks: int | None = None


@dataclass
class SchedulerOutput:
    """One engine step: which requests run, how many tokens each, and with which blocks."""

    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    # KV block copies to make before the step runs, in this order: swap-outs (device
    # block, host block), swap-ins (host block, device block), copy-on-write (src, dst).
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: draft tokens each request verifies this step. They are the
    # last len(drafts) of its num_scheduled_tokens, placed after its known tokens; the
    # step returns between 1 and len(drafts) + 1 tokens for it.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """What one model step produced, per request (plain lists)."""

    req_ids: list[str]
    # [] for a request still in the middle of its prompt; with draft tokens the accepted
    # drafts and then the one token sampled after them.
    sampled_token_ids: list[list[int]]
    logprobs: list[list[LogprobsEntry] | None] | None = None
    prompt_logprobs: dict[str, list[LogprobsEntry]] = field(default_factory=dict)
    # Speculative decoding: drafts proposed to follow each request's new tokens ([] for
    # none), or None when no proposer ran.
    spec_token_ids: list[list[int]] | None = None
    # Seconds the proposer ran after this step (None: it did not run), and, for a step that
    # verified drafts, seconds from its launch until its tokens were on the host (None:
    # no drafts in it).
    spec_draft_time_s: float | None = None
    spec_verify_time_s: float | None = None
    # Pooling requests whose prompt this step finished: their pooled vectors.
    pooled: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """New tokens (and maybe the end) of one request after one step."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobsEntry] | None = None
    new_prompt_logprobs: list[LogprobsEntry] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    pooled: list[float] | None = None  # a pooling request's result (it then finishes)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
