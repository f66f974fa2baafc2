"""Input processing: prompt forms -> validated token ids -> EngineCoreRequests.

Runs where the tokenizer lives (in the API process under the server), so a request the
engine core can never run is refused before it crosses the process boundary.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from kvflow.config import EngineConfig
from kvflow.core.sched_output import EngineCoreRequest
from kvflow.core.kv_cache_manager import freeable_window
from kvflow.core.scheduler import check_request_fits
from kvflow.errors import InvalidParameterError
from kvflow.pooling.params import PoolingParams, check_pooling_fits
from kvflow.sampling_params import OutputKind, SamplingParams

PromptType = str | list[int] | Mapping

# What the IPC messages can carry (msgspec: signed 64-bit integers) and the worker can
# turn into int64 tensors.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _int64(value: object, param: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or \
            not INT64_MIN <= value <= INT64_MAX:
        raise InvalidParameterError(f"{param} must be a 64-bit integer in [{INT64_MIN}, "
                                    f"{INT64_MAX}], got {value!r}", param=param)


def bound_for_engine(params: SamplingParams, vocab_size: int, max_model_len: int
                     ) -> SamplingParams:
    """The request's sampling values checked against this engine (vocabulary, context
    length, 64-bit integers) and bounded where a value simply means "no limit".

    Runs where a request enters the engine: in the InputProcessor (so nothing that cannot
    cross the process boundary is sent) and again in the EngineCore (defence in depth:
    whatever reaches the worker's tensors is in range). Returns ``params`` itself or a
    bounded copy; the caller's object is never changed.
    """
    for t in params.stop_token_ids or []:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InvalidParameterError(
                f"stop_token_ids must be token ids in [0, {vocab_size}), got {t!r}",
                param="stop_token_ids")
    for t in params.logit_bias or {}:
        if not 0 <= t < vocab_size:
            raise InvalidParameterError(
                f"logit_bias keys must be token ids in [0, {vocab_size}), got {t!r}",
                param="logit_bias")
    if params.min_tokens > max_model_len:
        raise InvalidParameterError(
            f"min_tokens must be at most the context length ({max_model_len}), got "
            f"{params.min_tokens}", param="min_tokens")
    if params.max_tokens is not None and params.max_tokens > INT64_MAX:
        raise InvalidParameterError(f"max_tokens must be at most {INT64_MAX}",
                                    param="max_tokens")
    if params.seed is not None:
        _int64(params.seed, "seed")
    # top_k at or above the vocabulary keeps every token: the same as no limit (vLLM).
    if params.top_k >= vocab_size:
        return params.clone(top_k=0)
    return params


@dataclass
class ProcessedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    core_requests: list[EngineCoreRequest]


def child_request_id(request_id: str, index: int, n: int) -> str:
    """Engine-core id of sample ``index`` of a request with ``n`` samples."""
    return request_id if n == 1 else f"{index}_{request_id}"


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer, num_blocks: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.num_blocks = num_blocks
        self.window = freeable_window(config)  # requests hold only its blocks (admission)
        eos = set(config.model.arch.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)
        self.vocab_size = config.model.arch.vocab_size
        from kvflow.structured_output.limits import DEFAULT_LIMITS

        # The server replaces these with its --structured-outputs-* limits.
        self.structured_limits = DEFAULT_LIMITS

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's recommended sampling settings applied."""
        return self.apply_defaults(SamplingParams())

    def apply_defaults(self, params: SamplingParams) -> SamplingParams:
        """Fill what the caller left unset: the model's sampling settings (explicit values
        win) and the operator's max_tokens default."""
        m = self.config.model
        params = params.with_defaults(dict(m.generation_defaults))
        if params.max_tokens is None and m.max_tokens_default is not None:
            params = params.clone(max_tokens=m.max_tokens_default)
        if params.repetition_guard is None:
            params = params.clone(repetition_guard=m.repetition_guard)
        return params

    def check_structured(self, params: SamplingParams, param: str | None = None) -> None:
        """Refuse a constraint this engine cannot run or must not compile (sizes, parse)."""
        from kvflow.structured_output.check import check_constraint

        if self.tokenizer is None or self.config.model.tokenizer is None:
            raise InvalidParameterError(
                "structured_outputs needs the model's tokenizer (this model has none)",
                param=param or "structured_outputs")
        check_constraint(params.structured_outputs, self.structured_limits, param)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self.encode(prompt["prompt"])
            raise InvalidParameterError("a prompt dict needs 'prompt' (text) or "
                                        "'prompt_token_ids'", param="prompt")
        if isinstance(prompt, (list, tuple)):
            return None, self._check_ids(prompt)
        raise InvalidParameterError(
            f"a prompt must be a string, a list of token ids or a dict, got "
            f"{type(prompt).__name__}", param="prompt")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise InvalidParameterError(
                "this model has no tokenizer (dummy weights or skip_tokenizer_init); pass "
                "prompts as token ids", param="prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _check_ids(self, ids) -> list[int]:
        ids = list(ids)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise InvalidParameterError(
                    f"prompt token ids must be integers in [0, {self.vocab_size}), got {t!r}",
                    param="prompt")
        return ids

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | None,
                arrival_time: float | None = None, priority: int = 0,
                cache_salt: str | None = None, pooling: PoolingParams | None = None,
                lora_request=None) -> ProcessedRequest:
        if pooling is not None:
            return self._process_pooling(request_id, prompt, pooling, arrival_time,
                                         priority, cache_salt)
        if params is None:
            params = self.default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise InvalidParameterError("sampling_params must be a SamplingParams",
                                        param="sampling_params")
        _int64(priority, "priority")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidParameterError("cache_salt must be a non-empty string",
                                        param="cache_salt")
        capped = params.max_tokens is None  # a default max_tokens is a cap, not a demand
        params = self.apply_defaults(params)
        cfg = self.config
        params = bound_for_engine(params, self.vocab_size, cfg.model.max_model_len)
        if params.structured_outputs is not None:
            self.check_structured(params)
        text, ids = self.tokenize_prompt(prompt)
        room = cfg.model.max_model_len - len(ids)
        if capped and params.max_tokens is not None and 0 < room < params.max_tokens:
            params = params.clone(max_tokens=room)  # as without a cap: up to the context
        check_request_fits(len(ids), params.max_tokens, cfg.model.max_model_len,
                           cfg.cache.block_size, self.num_blocks, self.window,
                           cfg.scheduler.max_prompt_chunk)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        n = params.n
        core = []
        for i in range(n):
            child = params if n == 1 else params.clone(
                n=1, seed=None if params.seed is None else params.seed + i)
            core.append(EngineCoreRequest(
                request_id=child_request_id(request_id, i, n), prompt_token_ids=ids,
                sampling_params=child, eos_token_ids=self.eos_token_ids,
                arrival_time=arrival, priority=priority,
                fork_of=None if i == 0 else child_request_id(request_id, 0, n),
                cache_salt=cache_salt, lora_request=lora_request))
        return ProcessedRequest(request_id, text, ids, params, core)

    def _process_pooling(self, request_id: str, prompt: PromptType, pooling: PoolingParams,
                         arrival_time: float | None, priority: int,
                         cache_salt: str | None) -> ProcessedRequest:
        """A pooling request: one engine-core request that is prefilled and pooled; its
        result comes back once, in ``RequestOutput.pooled``."""
        if not isinstance(pooling, PoolingParams):
            raise InvalidParameterError("pooling_params must be a PoolingParams",
                                        param="pooling_params")
        _int64(priority, "priority")
        cfg = self.config
        pooling.check_for_model(cfg.model.arch.hidden_size, self.vocab_size)
        try:
            text, ids = self.tokenize_prompt(prompt)
        except InvalidParameterError as e:  # pooling APIs call the prompt "input"
            raise InvalidParameterError(e.message, param="input") from None
        check_pooling_fits(len(ids), cfg.model.max_model_len, cfg.cache.block_size,
                           self.num_blocks)
        params = SamplingParams(max_tokens=None, detokenize=False,
                                output_kind=OutputKind.FINAL_ONLY)
        core = EngineCoreRequest(
            request_id=request_id, prompt_token_ids=ids, sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority, cache_salt=cache_salt, pooling=pooling)
        return ProcessedRequest(request_id, text, ids, params, [core])
