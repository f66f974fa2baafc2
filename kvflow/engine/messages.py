"""Every message the API process and the engine-core process exchange (rule 8 of
docs/architecture.md).

Messages are msgspec Structs in one tagged union, encoded with MessagePack: the decoder
checks each message against its schema, and nothing is ever pickled. The payload types
they carry (EngineCoreRequest, EngineCoreOutput, SamplingParams) are plain dataclasses
that msgspec encodes and checks field by field.

API -> core: AddRequest, Abort, FinishStopped, Shutdown.
Core -> API: Ready, Outputs, Stats, RequestError, RequestFailed, EngineError.
"""

from __future__ import annotations

import msgspec

from kvflow.core.sched_output import EngineCoreOutput, EngineCoreRequest


class CoreStats(msgspec.Struct, frozen=True):
    """A snapshot of the scheduler for logs and /metrics."""

    num_running: int
    num_waiting: int
    num_blocks: int
    num_used_blocks: int
    kv_cache_usage: float  # fraction of blocks held by requests
    num_preemptions: int  # since start
    num_steps: int  # engine steps that ran a model forward, since start
    # Speculative decoding, since start (all 0 when it is off): verification steps of a
    # request, draft tokens verified, drafts kept, and drafts kept per draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # ... proposer runs and their seconds, verification steps and their seconds.
    spec_num_proposals: int = 0
    spec_draft_time_s: float = 0.0
    spec_num_verify_steps: int = 0
    spec_verify_time_s: float = 0.0
    num_cached_blocks: int = 0  # free blocks that still hold a findable prefix
    num_shared_blocks: int = 0  # blocks held by more than one request
    block_map: str = ""  # one state digit per cell of blocks (kvflow.core.block_map)
    # --enable-lora: device slots holding an adapter, of how many; adapters moved into a
    # slot since start; distinct adapters among the running requests.
    lora_slots_used: int = 0
    lora_slots: int = 0
    lora_swaps: int = 0
    lora_running_adapters: int = 0
    # Constrained decoding, since start, in STRUCTURED_FIELDS order (empty: never used).
    structured: tuple[float, ...] = ()


# What CoreStats.structured holds, in order: (name, /metrics counter, help).
STRUCTURED_FIELDS = (
    ("num_compiles", "structured_compiles", "Grammars compiled (JSON schema, regex, "
     "choice, grammar)."),
    ("compile_s", "structured_compile_seconds", "Seconds spent compiling grammars."),
    ("num_cache_hits", "structured_compile_cache_hits", "Constrained requests whose "
     "grammar was already compiled."),
    ("num_errors", "structured_compile_errors", "Grammars that failed to compile."),
    ("num_masked_steps", "structured_masked_steps", "Engine steps that masked logits "
     "with a grammar."),
    ("num_masked_rows", "structured_masked_rows", "Sampled positions masked by a grammar."),
    ("fill_s", "structured_mask_fill_seconds", "Seconds spent filling grammar bitmasks "
     "(beside the forward)."),
    ("num_draft_rejections", "structured_draft_rejections", "Speculative drafts cut "
     "because the grammar forbids a draft token."),
)


def structured_fields(stats) -> tuple[float, ...]:
    """CoreStats.structured from a StructuredStats (kvflow.structured_output.manager)."""
    c = stats.compile
    return (c.num_compiles, c.compile_s, c.num_cache_hits, c.num_errors,
            stats.num_masked_steps, stats.num_masked_rows, stats.fill_s,
            stats.num_draft_rejections)


class AddRequest(msgspec.Struct, tag="add", frozen=True):
    """The samples of one API request (n of them), added all or none."""

    request_id: str
    requests: list[EngineCoreRequest]


class Abort(msgspec.Struct, tag="abort", frozen=True):
    """End these engine-core requests now (client gone, or the API gave up on them)."""

    request_ids: list[str]


class FinishStopped(msgspec.Struct, tag="finish", frozen=True):
    """Engine-core requests that matched a stop string during detokenization."""

    request_ids: list[str]
    stop_reasons: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    """Stop the loop, release the device and exit 0."""


class Ready(msgspec.Struct, tag="ready", frozen=True):
    """The engine core is up: sent once, after the model and the KV cache are ready."""

    num_blocks: int
    block_size: int
    max_model_len: int
    kv_cache_bytes: int
    device: str
    dtype: str
    startup_s: float
    pid: int
    determinism: str = ""  # batch-invariant | batch-variant (engine/determinism.py)
    determinism_why: str = ""
    fingerprint: str = ""  # system_fingerprint of every response


class Outputs(msgspec.Struct, tag="outputs", frozen=True):
    """What one engine step produced, and the scheduler's state after it."""

    outputs: list[EngineCoreOutput]
    stats: CoreStats
    step_s: float  # wall time of the step (schedule + forward + update)


class Stats(msgspec.Struct, tag="stats", frozen=True):
    """The scheduler's state changed without a step (aborts, admissions, idle)."""

    stats: CoreStats


class RequestError(msgspec.Struct, tag="request_error", frozen=True):
    """The core refused a request; the API raises this error for it."""

    request_id: str
    error_class: str  # name of a kvflow.errors class, e.g. QueueFullError
    message: str
    param: str | None = None


class RequestFailed(msgspec.Struct, tag="request_failed", frozen=True):
    """The core ended an engine-core request because a step failed on its data (see
    EngineCore.step); the engine goes on. The API fails the whole API request."""

    request_id: str  # engine-core (child) id
    message: str


class EngineError(msgspec.Struct, tag="engine_error", frozen=True):
    """The core hit an unexpected error and is exiting; ``message`` says why."""

    message: str


ToCore = AddRequest | Abort | FinishStopped | Shutdown
FromCore = Ready | Outputs | Stats | RequestError | RequestFailed | EngineError


class MessageCodec:
    """The one encoder/decoder pair for a direction of the socket pair."""

    def __init__(self, decode_type: type) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(decode_type)

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, data: bytes):
        return self._decoder.decode(data)


def api_codec() -> MessageCodec:
    """Codec of the API process: decodes what the core sends."""
    return MessageCodec(FromCore)


def core_codec() -> MessageCodec:
    """Codec of the engine-core process: decodes what the API sends."""
    return MessageCodec(ToCore)


def spec_fields(spec) -> dict:
    """CoreStats keyword arguments from the scheduler's SpecDecodingStats (or None)."""
    if spec is None:
        return {}
    return {"spec_num_drafts": spec.num_drafts, "spec_num_draft_tokens": spec.num_draft_tokens,
            "spec_num_accepted_tokens": spec.num_accepted_tokens,
            "spec_accepted_per_pos": tuple(spec.accepted_per_position),
            "spec_num_proposals": spec.num_proposals, "spec_draft_time_s": spec.draft_time_s,
            "spec_num_verify_steps": spec.num_verify_steps,
            "spec_verify_time_s": spec.verify_time_s}


def spec_totals(core: CoreStats | None) -> tuple:
    """The cumulative speculative-decoding counters of a CoreStats, in one order (the log
    line and /metrics take deltas of these): drafts, draft tokens, accepted tokens,
    proposer runs, their seconds, verification steps, their seconds. None: all zero."""
    if core is None:
        return (0, 0, 0, 0, 0.0, 0, 0.0)
    return (core.spec_num_drafts, core.spec_num_draft_tokens, core.spec_num_accepted_tokens,
            core.spec_num_proposals, core.spec_draft_time_s, core.spec_num_verify_steps,
            core.spec_verify_time_s)


__all__ = ["spec_fields", "spec_totals", "CoreStats", "AddRequest", "Abort", "FinishStopped", "Shutdown", "Ready",
           "Outputs", "Stats", "RequestError", "RequestFailed", "EngineError", "ToCore", "FromCore",
           "MessageCodec", "api_codec", "core_codec"]
