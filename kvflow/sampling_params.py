"""Sampling parameters of one request (pure Python: the scheduler reads them too)."""

from __future__ import annotations

import enum
import json as _json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvflow.errors import InvalidParameterError

# Below this temperature sampling is greedy (argmax), as in vLLM and OpenAI.
GREEDY_TEMPERATURE = 1e-5
# The most top-N logprobs a request may ask for, per generated or prompt token.
MAX_LOGPROBS = 20
# The longest repeated span the repetition guard may be asked to wait for.
MAX_REPETITION_GUARD = 1 << 16


# Sampling fields a model may recommend values for (generation_config.json, GGUF
# metadata, kvflow's registry), and the values that change nothing when none is given.
DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
            "repetition_penalty": 1.0}


class OutputKind(enum.Enum):
    """What each RequestOutput carries while a request runs."""

    CUMULATIVE = 0  # the whole text so far (offline API)
    DELTA = 1  # only what is new since the last output (streaming)
    FINAL_ONLY = 2  # nothing until the request finishes


def _check(ok: bool, param: str, rule: str, value: object) -> None:
    if not ok:
        raise InvalidParameterError(f"{param} must be {rule}, got {value!r}", param=param)


# Where a constraint's text is checked for size before it is compiled; the server's
# limits (server_args.py) are tighter. These only keep a runaway value out of the engine.
MAX_CONSTRAINT_CHARS = 1_000_000
MAX_CHOICES = 10_000


@dataclass
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's ``structured_outputs``).

    Exactly one of ``json``, ``regex``, ``choice``, ``grammar`` and ``json_object`` is
    set. The grammar engine (kvflow/structured_output/) compiles it off the engine loop;
    each step the sampler masks every token the constraint forbids, and end-of-sequence
    is allowed only where the constraint accepts the output so far.
    """

    json: str | dict | None = None
    """A JSON Schema (a dict, or its JSON text): the output is a JSON value it accepts."""
    regex: str | None = None
    """A regular expression the whole output matches (the xgrammar/ECMAScript dialect)."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A grammar in GBNF (llama.cpp's EBNF dialect, as xgrammar reads it; the start rule
    is ``root``): the output is a sentence of it."""
    json_object: bool = False
    """The output is any JSON object (``response_format: {"type": "json_object"}``)."""
    start_after: str | None = None
    """Constrain only what follows this text (e.g. ``"</think>"``: a reasoning model
    thinks freely, then its answer follows the constraint). Matched on token ids: the
    text as the tokenizer encodes it alone (a special token such as Qwen3's is one id).
    None: the whole output is constrained."""

    def __post_init__(self) -> None:
        set_ = [name for name in ("json", "regex", "choice", "grammar")
                if getattr(self, name) is not None]
        if not isinstance(self.json_object, bool):
            raise InvalidParameterError("structured_outputs.json_object must be a boolean",
                                        param="structured_outputs.json_object")
        if self.json_object:
            set_.append("json_object")
        if len(set_) != 1:
            raise InvalidParameterError(
                "structured_outputs needs exactly one of json, regex, choice, grammar and "
                f"json_object, got {', '.join(set_) if set_ else 'none'}",
                param="structured_outputs")
        if self.start_after is not None:
            _check(isinstance(self.start_after, str) and 0 < len(self.start_after) <= 256,
                   "structured_outputs.start_after", "a non-empty string of at most 256 "
                   "characters", self.start_after)
        if self.json is not None:
            self._check_json()
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                _check(isinstance(value, str) and 0 < len(value) <= MAX_CONSTRAINT_CHARS,
                       f"structured_outputs.{name}",
                       f"a non-empty string of at most {MAX_CONSTRAINT_CHARS} characters",
                       value if not isinstance(value, str) else value[:80])
        if self.choice is not None:
            _check(isinstance(self.choice, list) and 0 < len(self.choice) <= MAX_CHOICES
                   and all(isinstance(c, str) and c for c in self.choice)
                   and sum(map(len, self.choice)) <= MAX_CONSTRAINT_CHARS,
                   "structured_outputs.choice",
                   f"a list of 1 to {MAX_CHOICES} non-empty strings", self.choice[:8]
                   if isinstance(self.choice, list) else self.choice)

    def _check_json(self) -> None:
        param = "structured_outputs.json"
        if isinstance(self.json, str):
            _check(len(self.json) <= MAX_CONSTRAINT_CHARS, param,
                   f"at most {MAX_CONSTRAINT_CHARS} characters", len(self.json))
            try:
                schema = _json.loads(self.json)
            except ValueError as e:
                raise InvalidParameterError(f"{param} is not valid JSON: {e}",
                                            param=param) from None
        else:
            schema = self.json
        _check(isinstance(schema, (dict, bool)), param,
               "a JSON Schema (an object, or its JSON text)", type(schema).__name__)

    @property
    def kind(self) -> str:
        """Which constraint is set: json, regex, choice, grammar or json_object."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints have equal keys (the compile cache's
        key; a schema's key does not depend on its spacing or on whether it came as a dict
        or as text). Key order is kept: the output follows the schema's property order."""
        kind = self.kind
        if kind == "json":
            value = _json.loads(self.json) if isinstance(self.json, str) else self.json
            return kind, _json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        if kind == "choice":
            return kind, _json.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop. Field names follow vLLM's."""

    n: int = 1
    """Number of samples to return for the prompt; they share the prompt's KV blocks."""
    temperature: float | None = None
    """Softmax temperature; 0 means greedy. None (as for top_p, top_k, min_p and
    repetition_penalty): the model's recommended value (see ``with_defaults``), else 1.0."""
    top_p: float | None = None
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int | None = None
    """Keep the k most likely tokens; 0 or -1 keeps all."""
    min_p: float | None = None
    """Drop tokens whose probability is below min_p times the top token's."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated."""
    repetition_penalty: float | None = None
    """Divides positive (multiplies negative) logits of tokens in prompt or output."""
    seed: int | None = None
    """Per-request seed: the same output whatever else shares the batch."""
    logit_bias: dict[int, float] | None = None
    """Token id -> value in [-100, 100] added to its logit before sampling (OpenAI's
    ``logit_bias``): -100 in effect bans a token, +100 in effect forces it. Applies to
    greedy requests too; returned logprobs stay the model's own."""
    stop: str | list[str] | None = None
    """Strings that end generation; removed from the output unless asked otherwise."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (in addition to end-of-sequence)."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence tokens."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to the model's context length."""
    min_tokens: int = 0
    """Fewest tokens to generate before end-of-sequence or stop ids may end the request."""
    repetition_guard: int | None = None
    """End the request (finish_reason "stop", stop_reason "repetition") once its output
    ends in one block of tokens repeated over at least this many tokens and three times
    (kvflow/core/repetition.py); 0 turns it off; None: the engine's default
    (``--repetition-guard``). Never fires with ignore_eos or before min_tokens."""
    logprobs: int | None = None
    """Return this many top logprobs (plus the sampled token's) per generated token."""
    prompt_logprobs: int | None = None
    """Return this many top logprobs per prompt token."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    spaces_between_special_tokens: bool = True
    """Put a space between special tokens in the text (when they are not skipped)."""
    detokenize: bool = True
    """Produce text; when False only token ids are returned (stop strings unavailable)."""
    output_kind: OutputKind = OutputKind.CUMULATIVE
    """Cumulative, delta (streaming) or final-only outputs."""
    structured_outputs: StructuredOutputsParams | None = None
    """A constraint (JSON schema, regex, choice, grammar) the output must satisfy."""
    # Derived in __post_init__:
    stop_strings: list[str] = field(init=False, default_factory=list)
    all_stop_token_ids: set[int] = field(init=False, default_factory=set)
    defaulted: frozenset[str] = field(init=False, default=frozenset())
    """The fields of DEFAULTABLE left unset (None); they hold neutral values until
    ``with_defaults`` fills in the model's recommendation."""

    def __post_init__(self) -> None:
        unset = [name for name in DEFAULTABLE if getattr(self, name) is None]
        # A copy that travels between processes arrives resolved; keep what it had.
        self.defaulted = frozenset(unset) | (self.defaulted or frozenset())
        for name in unset:
            setattr(self, name, _NEUTRAL[name])
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        try:
            self._validate()
        except TypeError as e:  # e.g. a string where a number belongs
            raise InvalidParameterError(f"invalid sampling parameter type: {e}") from None
        if self.temperature < GREEDY_TEMPERATURE:
            # Greedy: the filters cannot change the argmax, so turn them off.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", "an integer >= 1", self.n)
        for name in ("temperature", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            _check(not isinstance(value, bool) and isinstance(value, (int, float))
                   and math.isfinite(value), name, "a finite number", value)
        _check(self.temperature >= 0.0, "temperature", ">= 0", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k",
               "-1, 0 (disabled) or an integer >= 1", self.top_k)
        _check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]", self.min_p)
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]",
               self.presence_penalty)
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]",
               self.frequency_penalty)
        _check(self.repetition_penalty > 0.0, "repetition_penalty", "> 0",
               self.repetition_penalty)
        if self.seed is not None:
            _check(isinstance(self.seed, int) and not isinstance(self.seed, bool)
                   and -(2**63) <= self.seed < 2**63, "seed", "a 64-bit integer", self.seed)
        if self.max_tokens is not None:
            _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
                   "an integer >= 1", self.max_tokens)
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
               "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        if self.repetition_guard is not None:
            _check(isinstance(self.repetition_guard, int)
                   and not isinstance(self.repetition_guard, bool)
                   and 0 <= self.repetition_guard <= MAX_REPETITION_GUARD,
                   "repetition_guard", f"an integer in [0, {MAX_REPETITION_GUARD}]",
                   self.repetition_guard)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(isinstance(value, int) and 0 <= value <= MAX_LOGPROBS, name,
                       f"an integer in [0, {MAX_LOGPROBS}]", value)
        for s in self.stop_strings:
            _check(isinstance(s, str) and len(s) > 0, "stop", "a list of non-empty strings", s)
        for t in self.stop_token_ids or []:
            _check(isinstance(t, int) and t >= 0, "stop_token_ids",
                   "a list of non-negative token ids", t)
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, Mapping), "logit_bias",
                   "a mapping of token ids to numbers", self.logit_bias)
            for t, v in self.logit_bias.items():
                _check(isinstance(t, int) and not isinstance(t, bool) and t >= 0,
                       "logit_bias", "keyed by non-negative token ids", t)
                _check(not isinstance(v, bool) and isinstance(v, (int, float))
                       and math.isfinite(v) and -100.0 <= v <= 100.0, "logit_bias",
                       "a mapping to numbers in [-100, 100]", v)
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise InvalidParameterError("structured_outputs must be a StructuredOutputsParams",
                                        param="structured_outputs")
        if self.stop_strings and not self.detokenize:
            raise InvalidParameterError("stop strings need detokenize=True", param="stop")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def clone(self, **changes: object) -> "SamplingParams":
        """A copy with some fields changed (validated again); unset fields stay unset."""
        base = {k: getattr(self, k) for k in self.__dataclass_fields__
                if self.__dataclass_fields__[k].init}
        base.update({k: None for k in self.defaulted})
        base.update(changes)
        return SamplingParams(**base)

    def with_defaults(self, defaults: Mapping[str, object]) -> "SamplingParams":
        """These params with ``defaults`` (the model's recommended sampling settings)
        filling the fields the caller left unset; explicit values always win."""
        fill = {k: v for k, v in defaults.items() if k in self.defaulted}
        if not fill:
            return self
        out = self.clone(**fill)
        out.defaulted = self.defaulted - fill.keys()
        return out


__all__ = ["SamplingParams", "StructuredOutputsParams", "OutputKind", "DEFAULTABLE", "GREEDY_TEMPERATURE", "MAX_LOGPROBS"]
