"""The one object that carries a request's state inside the engine core (rule 1 of
docs/architecture.md).

Only the scheduler and the KV cache manager change a Request.
"""

from __future__ import annotations

import enum
import time

from kvflow.pooling.params import PoolingParams
from kvflow.lora.request import LoRARequest
from kvflow.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """A single sequence to generate (one sample: ``n > 1`` becomes n Requests)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] | set[int] = frozenset(),
        arrival_time: float | None = None,
        priority: int = 0,
        fork_parent: "Request | None" = None,
        cache_salt: str | None = None,
        pooling: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.num_prompt_tokens = len(prompt_token_ids)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens a scheduled step will sample but whose values are not known yet
        # (at most one per step in flight).
        self.num_placeholders = 0
        self.block_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.num_cached_tokens = 0
        # Set by the scheduler when the request is admitted (limits resolved there).
        self.max_tokens: int = sampling_params.max_tokens or 0
        # n > 1: the sample that computes the prompt; this one then shares its blocks.
        self.fork_parent = fork_parent
        # The client request this sample belongs to (its n samples share one id): the
        # unit the scheduler shares seats and prompt tokens between (core/fairness.py).
        self.group_id: str = fork_parent.group_id if fork_parent is not None else request_id
        # Prefix caching: chained hashes of the full blocks so far; the salt keeps
        # requests that must not share cached KV apart.
        self.cache_salt = cache_salt
        self.lora_request = lora_request  # the adapter (None: the base model)
        self.block_hashes: list[bytes] = []
        # Swap preemption: host blocks holding this request's KV while it waits, and how
        # many tokens they hold.
        self.swapped_blocks: list[int] = []
        self.num_swapped_tokens = 0
        # Speculative decoding: draft tokens proposed to follow the known tokens (verified
        # the next time the request is scheduled), and how many drafts the step in flight
        # verifies (the request is not scheduled again until that step's result is in,
        # since it may keep anywhere from none to all of them).
        self.spec_token_ids: list[int] = []
        self.num_drafts_in_flight = 0
        # Pooling: owed its prompt tokens only; it finishes when the worker has pooled
        # them (never samples).
        self.pooling = pooling

    # --- token bookkeeping -------------------------------------------------
    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def num_tokens_scheduled_for(self) -> int:
        """Known tokens plus those being sampled: what the next step continues from."""
        return len(self.all_token_ids) + self.num_placeholders

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    # --- status -------------------------------------------------------------
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def sort_key(self) -> tuple[int, float, str]:
        """Order of service: lower priority value first, then earlier arrival (FCFS)."""
        return (self.priority, self.arrival_time, self.request_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_ids})")
