"""What the offline API and the server hand back (plain data, shaped like vLLM's)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log probability of one candidate token at one position."""

    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the sampled token plus the top-N).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sample of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    # "stop", "length", "abort", "error" (the engine could not run it; RequestOutput.extra
    # ["error"] says why) or None while running
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its samples so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict)
    pooled: list[float] | None = None  # a pooling request's vector (PoolingRequestOutput)


@dataclass
class PoolingRequestOutput:
    """The result of one pooling request (``LLM.embed``, ``/v1/embeddings``): an
    embedding, or for a cross-encoder the logits it scores with."""

    request_id: str
    prompt_token_ids: list[int]
    data: list[float]
    finished: bool = True
    num_cached_tokens: int = 0

    @classmethod
    def from_request_output(cls, out: RequestOutput) -> "PoolingRequestOutput":
        return cls(out.request_id, out.prompt_token_ids, list(out.pooled or []),
                   out.finished, out.num_cached_tokens)
