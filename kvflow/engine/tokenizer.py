"""The tokenizer: a thin wrapper over a Rust ``tokenizers.Tokenizer`` plus the special tokens
and chat templates of a Hugging Face directory or a GGUF file.

transformers is never needed at runtime: a GGUF file's vocabulary is rebuilt here with the
``tokenizers`` library, the way the model's original ``tokenizer.json`` (and llama.cpp) split
text. Objects are immutable after construction, so one instance serves a thread pool.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import tokenizers
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, \
    processors

from kvflow.errors import InvalidParameterError, KvflowError, ModelLoadError, \
    ModelNotFoundError
from kvflow.logger import init_logger
from kvflow.models.gguf_header import cached_gguf_header

logger = init_logger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> how that vocabulary's text was split when its merges were learned.
_GGUF_PRE = {"smollm": "digits", "starcoder": "digits", "refact": "digits",
             "llama-bpe": "llama3", "llama3": "llama3", "llama-v3": "llama3",
             "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2", "default": "gpt2", "gpt-2": "gpt2"}


class Tokenizer:
    """Text <-> token ids, special tokens and chat templates of one model."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, pad_token: str | None = None,
                 unk_token: str | None = None, add_bos_token: bool | None = None,
                 add_eos_token: bool | None = None, extra_eos_token_ids: Iterable[int] = (),
                 chat_templates: Mapping[str, str] | None = None) -> None:
        """Wrap ``backend`` (this takes ownership: it is configured here, then never changed).

        ``add_bos_token``/``add_eos_token``: None keeps the backend's post-processor (e.g. the
        one in tokenizer.json); a bool replaces it, as transformers 4's Llama-family
        tokenizers did when tokenizer_config.json states the flag. ``chat_templates`` maps
        names to templates; the one named "default" is used unless a call picks another.
        """
        self._backend = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.pad_token, self.unk_token = pad_token, unk_token
        named = [t for t in (bos_token, eos_token, pad_token, unk_token) if t is not None]
        # Named special tokens must be matched whole in text and skipped by decode.
        special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        missing = [t for t in named if t not in special and backend.token_to_id(t) is not None]
        if missing:
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                        for t in missing])
        self.bos_token_id = self._id_of(bos_token)
        self.eos_token_id = self._id_of(eos_token)
        self.pad_token_id = self._id_of(pad_token)
        self.unk_token_id = self._id_of(unk_token)
        if add_bos_token is not None or add_eos_token is not None:
            backend.post_processor = self._bos_eos_processor(bool(add_bos_token),
                                                             bool(add_eos_token))
        eos_ids = {self.eos_token_id, *extra_eos_token_ids} - {None}
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        self.all_special_ids: frozenset[int] = frozenset(
            {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
            | {i for i in (self.bos_token_id, self.eos_token_id, self.pad_token_id,
                           self.unk_token_id) if i is not None})
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    # ---- loading ----------------------------------------------------------------------------

    @classmethod
    def from_path(cls, path: str | os.PathLike) -> Tokenizer:
        """Load from a Hugging Face directory (tokenizer.json ...) or a .gguf file."""
        path = os.fspath(path)
        if os.path.isdir(path):
            if os.path.isfile(os.path.join(path, "tokenizer.json")):
                return _load_hf_dir(cls, path)
            ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
            if ggufs:
                return cls.from_gguf(os.path.join(path, ggufs[0]))
            raise ModelLoadError(
                f"{path} has no tokenizer.json and no .gguf file. kvflow reads the fast "
                f"tokenizer format: if the model only ships tokenizer.model, save its "
                f"tokenizer once with transformers (save_pretrained) to create tokenizer.json")
        if os.path.isfile(path):
            if path.endswith(".gguf"):
                return cls.from_gguf(path)
            if os.path.basename(path) == "tokenizer.json":
                return _load_hf_dir(cls, os.path.dirname(path) or ".")
            raise ModelLoadError(f"{path} is neither a tokenizer directory nor a .gguf file")
        raise ModelNotFoundError(f"tokenizer path {path} does not exist")

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        """Build the tokenizer described by a GGUF file's ``tokenizer.*`` metadata."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ModelNotFoundError(f"GGUF file {path} does not exist")
        # The header the model's architecture and weights were read from (parsed once:
        # the vocabulary's strings are most of its parse time).
        fields = {k: v for k, v in cached_gguf_header(path).fields.items()
                  if k.startswith("tokenizer.")}
        try:
            return cls._from_gguf_fields(fields, path)
        except KvflowError:
            raise
        except Exception as e:  # malformed metadata; the Rust library raises plain Exceptions
            raise ModelLoadError(f"{path}: cannot build the tokenizer from GGUF metadata: "
                                 f"{type(e).__name__}: {e}") from None

    @classmethod
    def _from_gguf_fields(cls, fields: dict[str, Any], path: str) -> Tokenizer:
        def meta(key: str, default: Any = None) -> Any:
            value = fields.get(f"tokenizer.{key}")
            return default if value is None else value

        kind, tokens = meta("ggml.model"), meta("ggml.tokens")
        if not tokens:
            raise ModelLoadError(f"{path}: the GGUF file has no tokenizer vocabulary")
        types = meta("ggml.token_type") or [1] * len(tokens)
        add_bos = meta("ggml.add_bos_token")
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, meta("ggml.merges") or [],
                                      meta("ggml.pre", "default"))
        elif kind == "llama":
            backend = _sentencepiece_bpe(tokens, meta("ggml.scores"),
                                         meta("ggml.add_space_prefix", True))
            # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
            add_bos = True if add_bos is None else add_bos
        else:
            raise ModelLoadError(f"{path}: GGUF tokenizer model {kind!r} is not supported "
                                 f"(supported: gpt2, llama)")
        # Control tokens (<|im_start|>) must encode whole from chat-template text and be
        # skipped by decode; user-defined ones (<think>) are matched whole but kept.
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, k in zip(tokens, types) if k == _CONTROL])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, k in zip(tokens, types) if k == _USER_DEFINED])

        def token(key: str) -> str | None:
            i = meta(f"ggml.{key}")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        templates = {}
        if meta("chat_template"):
            templates["default"] = meta("chat_template")
        for name in meta("chat_templates") or []:  # llama.cpp's named extra templates
            if meta(f"chat_template.{name}"):
                templates[name] = meta(f"chat_template.{name}")
        extra_eos = [meta(f"ggml.{k}") for k in ("eot_token_id", "eom_token_id")]
        return cls(backend, bos_token=token("bos_token_id"), eos_token=token("eos_token_id"),
                   pad_token=token("padding_token_id"), unk_token=token("unknown_token_id"),
                   add_bos_token=bool(add_bos), add_eos_token=bool(meta("ggml.add_eos_token")),
                   extra_eos_token_ids=[int(i) for i in extra_eos if i is not None],
                   chat_templates=templates)

    # ---- encode / decode --------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with add_special_tokens, BOS/EOS as the config says."""
        if not isinstance(text, str):
            raise InvalidParameterError(f"text to tokenize must be a string, got "
                                        f"{type(text).__name__}", param="prompt")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = False) -> str:
        """Text of ``ids`` (ids outside the vocabulary are ignored).

        ``spaces_between_special_tokens`` only matters when special tokens are kept: it puts
        a space between each kept special token and its neighbours, as Hugging Face's slow
        tokenizers did (their fast tokenizers, like plain ``decode`` here, put none).
        """
        ids = list(ids)
        if skip_special_tokens or not spaces_between_special_tokens:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self.all_special_ids:
                if run:
                    parts.append(self._backend.decode(run, skip_special_tokens=False))
                    run = []
                parts.append(self._backend.decode([i], skip_special_tokens=False))
            else:
                run.append(i)
        if run:
            parts.append(self._backend.decode(run, skip_special_tokens=False))
        return " ".join(parts)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Vocabulary strings of ``ids`` ("" for an id outside the vocabulary)."""
        return [self._backend.id_to_token(i) or "" for i in ids]

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary string, or None."""
        return self._backend.token_to_id(token)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped Rust tokenizer (treat as read-only)."""
        return self._backend

    # ---- chat templates ---------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The default chat template, or None when the model has none."""
        return self.chat_templates.get("default")

    def with_chat_template(self, template: str | None) -> Tokenizer:
        """This tokenizer with ``template`` as its default chat template (the operator's
        --chat-template); None keeps the model's. The model's named templates stay."""
        if template is not None:
            self.chat_templates["default"] = template
        return self

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            chat_template: str | None = None, max_chars: int | None = None,
                            **template_kwargs: Any) -> str:
        """Render ``messages`` with the model's chat template.

        ``chat_template`` picks a named template of the model or is a template itself;
        ``template_kwargs`` (tools, documents, enable_thinking ...) reach the template as
        variables. Bad messages or a failing template raise InvalidParameterError, and so
        does a rendering that grows past ``max_chars`` (it stops there).
        """
        template = self._pick_template(chat_template, template_kwargs.get("tools"))
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            raise InvalidParameterError("messages must be a list of objects with a role and "
                                        "content", param="messages")
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                     "pad_token": self.pad_token, "unk_token": self.unk_token,
                     "tools": None, "documents": None, **template_kwargs,
                     "messages": messages, "add_generation_prompt": add_generation_prompt}
        try:
            compiled = _compile_template(template)  # a request's own may not compile
            if max_chars is None:
                return compiled.render(**variables)
            parts, size = [], 0
            for piece in compiled.generate(**variables):
                size += len(piece)
                if size > max_chars:
                    raise InvalidParameterError(
                        f"the chat template renders these messages to more than "
                        f"{max_chars} characters", param="messages")
                parts.append(piece)
            return "".join(parts)
        except InvalidParameterError:
            raise
        except Exception as e:  # the template's raise_exception, type errors on odd input ...
            raise InvalidParameterError(f"the chat template cannot render these messages: "
                                        f"{type(e).__name__}: {e}", param="messages") from None

    def _pick_template(self, chosen: str | None, tools: Any) -> str:
        if chosen is not None:
            return self.chat_templates.get(chosen, chosen)
        if tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if self.chat_template is None:
            raise InvalidParameterError(
                "this model's tokenizer has no chat template, so chat messages cannot be "
                "turned into a prompt: pass one with --chat-template (a file or inline "
                "Jinja) or a request's chat_template, or send a plain completion prompt "
                "instead", param="messages")
        return self.chat_template

    # ---- helpers ----------------------------------------------------------------------------

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def _bos_eos_processor(self, add_bos: bool, add_eos: bool):
        bos = self.bos_token if add_bos and self.bos_token_id is not None else None
        eos = self.eos_token if add_eos and self.eos_token_id is not None else None
        if bos is None and eos is None:
            return None
        pre, post = (f"{bos}:0 " if bos else ""), (f" {eos}:0" if eos else "")
        pre1, post1 = (f" {bos}:1" if bos else ""), (f" {eos}:1" if eos else "")
        special = [(t, self._id_of(t)) for t in dict.fromkeys((bos, eos)) if t is not None]
        return processors.TemplateProcessing(single=f"{pre}$A:0{post}",
                                             pair=f"{pre}$A:0{post}{pre1} $B:1{post1}",
                                             special_tokens=special)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
                f"eos={self.eos_token!r}, chat_template={self.chat_template is not None})")


# ---- GGUF vocabularies ----------------------------------------------------------------------

def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a repeated string keeps its first id, as llama.cpp does
    return vocab


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> tokenizers.Tokenizer:
    """GPT-2 style byte-level BPE; ``pre`` (tokenizer.ggml.pre) picks the text splitting."""
    style = _GGUF_PRE.get(pre)
    if style is None:
        # The split decides the token ids: GPT-2's on another family's vocabulary gives
        # ids llama.cpp would not, silently. Refuse instead.
        raise ModelLoadError(
            f"the GGUF file's pre-tokenizer (tokenizer.ggml.pre) {pre!r} is not supported "
            f"(supported: {', '.join(sorted(_GGUF_PRE))}); its text splitting decides the "
            f"token ids, so kvflow will not guess it. Point --tokenizer at the model's "
            f"Hugging Face folder (its tokenizer.json) instead")
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    # Llama 3's tokenizer.json (and llama.cpp) take a whole word from the vocabulary first.
    backend = tokenizers.Tokenizer(models.BPE(
        vocab=_vocab(tokens), merges=pairs, fuse_unk=False, ignore_merges=style == "llama3"))
    if style in ("gpt2", "digits"):
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        # SmolLM/StarCoder's tokenizer.json isolates every digit before the GPT-2 regex.
        backend.pre_tokenizer = byte_level if style == "gpt2" else pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        split = _LLAMA3_SPLIT if style == "llama3" else _QWEN2_SPLIT
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        if style == "qwen2":
            backend.normalizer = normalizers.NFC()  # as in Qwen2's own tokenizer.json
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], scores: list[float] | None,
                       add_space_prefix: bool) -> tokenizers.Tokenizer:
    """SentencePiece BPE (Llama 1/2, Mistral): ▁ marks spaces, <0xNN> tokens spell bytes.

    GGUF files keep scores, not merges: SentencePiece merges the adjacent pair whose result
    scores best, which is BPE with the merges ranked by the merged token's score.
    """
    vocab = _vocab(tokens)
    scores = list(scores) if scores is not None else [-float(i) for i in range(len(tokens))]
    merges = []
    for token, score in zip(tokens, scores):
        local = [(token[:k], token[k:], score) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    # Same order as transformers' generate_merges (stable, best score first).
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    backend = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=[(a, b) for a, b, _ in merges], fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # the space the pre-tokenizer added
    backend.decoder = decoders.Sequence(steps)
    return backend


# ---- Hugging Face directories ---------------------------------------------------------------

def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None


def _chat_templates(folder: str, config: dict) -> dict[str, str]:
    """Named chat templates; a chat_template.jinja file overrides the config's default."""
    value = config.get("chat_template")
    templates: dict[str, str] = {}
    if isinstance(value, str):
        templates["default"] = value
    elif isinstance(value, list):  # [{"name": "default", "template": "..."}, ...]
        templates.update({t["name"]: t["template"] for t in value if isinstance(t, dict)
                          and isinstance(t.get("name"), str)
                          and isinstance(t.get("template"), str)})
    if os.path.isfile(os.path.join(folder, "chat_template.jinja")):
        templates["default"] = _read_text(os.path.join(folder, "chat_template.jinja"))
    extra = os.path.join(folder, "additional_chat_templates")
    if os.path.isdir(extra):
        for name in sorted(os.listdir(extra)):
            if name.endswith(".jinja"):
                templates[name[:-len(".jinja")]] = _read_text(os.path.join(extra, name))
    return templates


def _load_hf_dir(cls: type[Tokenizer], folder: str) -> Tokenizer:
    path = os.path.join(folder, "tokenizer.json")
    try:
        backend = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the Rust library raises plain Exceptions on bad files
        raise ModelLoadError(f"cannot load {path} (corrupt, or written by a newer tokenizers "
                             f"library?): {e}") from None
    config = _read_json(os.path.join(folder, "tokenizer_config.json"))
    special_map = _read_json(os.path.join(folder, "special_tokens_map.json"))

    def special(name: str) -> str | None:
        return _token_text(config.get(name)) or _token_text(special_map.get(name))

    def flag(name: str) -> bool | None:
        value = config.get(name)
        return value if isinstance(value, bool) else None

    eos = _read_json(os.path.join(folder, "generation_config.json")).get("eos_token_id")
    extra_eos = eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
    templates = _chat_templates(folder, config)
    try:
        return cls(backend, bos_token=special("bos_token"), eos_token=special("eos_token"),
                   pad_token=special("pad_token"), unk_token=special("unk_token"),
                   add_bos_token=flag("add_bos_token"), add_eos_token=flag("add_eos_token"),
                   extra_eos_token_ids=[i for i in extra_eos if isinstance(i, int)],
                   chat_templates=templates)
    except Exception as e:  # e.g. a special token the BOS/EOS template cannot express
        raise ModelLoadError(f"{folder}: cannot set up the tokenizer's special tokens: "
                             f"{type(e).__name__}: {e}") from None


# ---- chat template rendering ----------------------------------------------------------------

class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks in
    some templates; rendering for inference keeps the body as is."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@lru_cache(maxsize=16)
def _compile_template(template: str) -> jinja2.Template:
    """A sandboxed jinja2 template with the helpers Hugging Face chat templates expect."""

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters and non-ASCII text; templates want
        # neither.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols",
                                                    _GenerationTag])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise InvalidParameterError(f"the chat template is not valid jinja (line {e.lineno}): "
                                    f"{e.message}", param="chat_template") from None
