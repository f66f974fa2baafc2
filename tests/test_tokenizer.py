"""kvflow.engine.tokenizer against transformers as the reference.

transformers' GGUF tokenizer is built by ``TokenizersBackend.from_pretrained(folder,
gguf_file=...)``: that is the class ``AutoTokenizer.from_pretrained`` returns for these files,
minus AutoTokenizer's model-config parse (3.5 s of gguf.GGUFReader), which the tokenizer
does not use.
"""

from __future__ import annotations

import json
import os
import threading

import gguf
import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from kvflow.engine.tokenizer import Tokenizer
from kvflow.errors import InvalidParameterError, ModelLoadError, ModelNotFoundError

TokenizersBackend = pytest.importorskip(
    "transformers.tokenization_utils_tokenizers").TokenizersBackend

CORPUS = [
    "Hello world", "The quick brown fox jumps over the lazy dog.", "", " ", "   ", "\n",
    "a\n\nb",
    "trailing spaces   ", "  leading", "tabs\tand\t\tmore\ttabs", "line one\r\nline two\n\n\n",
    "x  y   z    w", "2024", "3.14159", "1,000,000 and 42%", "a1b22c333", "v1.2.3-rc4",
    "Punctuation!!! ??? ... --- (parens) [brackets] {braces} <angles> @#$%^&*_+=|\\/~`",
    "It's a dog's life; we'll see, they've said, I'd've", "CAPS and MiXeD case",
    "😀 emoji 👍🏽 🇺🇸 👨‍👩‍👧‍👦 ❤️", "日本語のテキスト", "中文测试：你好，世界！", "한국어 텍스트입니다",
    "naïve café résumé façade Ångström", "e\u0301 decomposed vs é composed",
    "Россия и Україна",
    "مرحبا بالعالم", "हिन्दी पाठ", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more", "<repo_name>kvflow<file_sep>",
    "def f(x):\n    return x ** 2  # square\n",
    '{"json": [1, 2.5, null], "ü": "ß"}', "mixed 日本 and emoji 🎉 and 123 in one line",
    "\u200bzero width\u00a0nbsp", "🎉" * 7,
]
# SmolLM2's own tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) isolate digits before
# the GPT-2 regex; transformers' GGUF loader does not, which shows when whitespace precedes a
# digit: "  1" is [ĠĠ, 1] for the original tokenizer but [Ġ, Ġ, 1] there. We match the
# original, which the model was trained with.
DIGIT_AFTER_SPACES = ["  1", "x  12  y", "\t\t7", "  2024"]

MESSAGES = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "Und auf Deutsch? 😀"}],
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    from kvflow.models.registry import embedded_model_path

    try:
        return embedded_model_path("smollm2-135m")
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smollm(gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def reference(gguf_path):
    return TokenizersBackend.from_pretrained(os.path.dirname(gguf_path),
                                             gguf_file=os.path.basename(gguf_path))


# ---- the embedded SmolLM2 GGUF ------------------------------------------------------------

def test_gguf_special_tokens(smollm):
    assert (smollm.bos_token_id, smollm.eos_token_id, smollm.pad_token_id) == (1, 2, 2)
    assert smollm.unk_token_id == 0 and smollm.eos_token_ids == {2}
    assert smollm.vocab_size == len(smollm) == 49152
    assert smollm.all_special_ids == set(range(17))  # the file's 17 control tokens
    assert smollm.encode("hi") == smollm.encode("hi", add_special_tokens=False)  # no BOS


@pytest.mark.parametrize("text", CORPUS)
def test_gguf_matches_transformers(smollm, reference, text):
    ids = smollm.encode(text)
    assert ids == reference.encode(text)
    assert smollm.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
    for skip in (True, False):
        assert smollm.decode(ids, skip_special_tokens=skip) == reference.decode(
            ids, skip_special_tokens=skip)
    if "<|" not in text and "<repo" not in text:
        assert smollm.decode(ids) == text


@pytest.mark.parametrize("text", DIGIT_AFTER_SPACES)
def test_gguf_digits_follow_the_original_tokenizer(smollm, reference, text):
    ids = smollm.encode(text)
    tokens = smollm.convert_ids_to_tokens(ids)
    assert all(len(t) == 1 for t in tokens if any(c.isdigit() for c in t))  # digits isolated
    assert "ĠĠ" in tokens or "ĉĉ" in tokens  # the whitespace run stays one token
    assert ids != reference.encode(text)  # the known transformers difference
    assert smollm.decode(ids) == reference.decode(reference.encode(text)) == text


def test_special_tokens_in_text_encode_whole(smollm):
    ids = smollm.encode("<|im_start|>user<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 3
    assert smollm.decode(ids) == "user"
    assert smollm.decode(ids, skip_special_tokens=False) == "<|im_start|>user<|im_end|>"
    assert smollm.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=True) \
        == "<|im_start|> user <|im_end|>"


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gguf_chat_template_matches_transformers(smollm, reference, messages,
                                                 add_generation_prompt):
    text = smollm.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert smollm.encode(text) == reference.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt)["input_ids"]


def test_shared_by_threads(smollm):
    """The server tokenizes from a thread pool: one instance, no per-call state."""
    def run() -> tuple:
        ids = [smollm.encode(t) for t in CORPUS]
        return ids, [smollm.decode(i) for i in ids], [
            smollm.apply_chat_template(m) for m in MESSAGES]

    expected = run()
    results: list[bool] = []

    def work() -> None:
        results.extend(run() == expected for _ in range(10))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 80 and all(results)


# ---- small GGUF files written here ---------------------------------------------------------

TRAIN_TEXT = ["The quick brown fox jumps over the lazy dog 12345.",
              "hello there, hello again!",
              "naïve café résumé, über straße 日本語", "def main():\n    return 42\n",
              "the theory of everything", "It's a lovely day; isn't it? We'll see. 2024"] * 20


def _train(pre_tokenizer, vocab_size: int, **kw) -> dict:
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizer
    rust.train_from_iterator(TRAIN_TEXT, trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False, **kw))
    return json.loads(rust.to_str())["model"]


def _write_gguf(path, tokens, types, bools: dict[str, bool] | None = None, **fields) -> str:
    """A GGUF file with only metadata; ``fields`` name GGUFWriter.add_* helpers."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    for key, value in fields.items():
        getattr(w, f"add_{key}")(value)
    for key, value in (bools or {}).items():  # keys gguf has no helper for
        w.add_bool(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _spm_gguf(path, **fields) -> str:
    """A Llama-style sentencepiece vocabulary: control, byte and scored tokens."""
    model = _train(pre_tokenizers.Metaspace(prepend_scheme="always"), 300)
    pieces = sorted(model["vocab"], key=model["vocab"].get)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types, scores = [2, 3, 3] + [6] * 256, [0.0] * 259
    for rank, piece in enumerate(pieces):
        if piece not in tokens:
            tokens.append(piece)
            types.append(1)
            scores.append(-float(rank))  # sentencepiece BPE: earlier merges score higher
    tokens.append("<|tool|>")
    types.append(4)
    scores.append(0.0)
    return _write_gguf(path, tokens, types, tokenizer_model="llama", token_scores=scores,
                       bos_token_id=1, eos_token_id=2, unk_token_id=0, **fields)


def _byte_level_gguf(path, pre: str, **fields) -> str:
    model = _train(pre_tokenizers.ByteLevel(add_prefix_space=False), 400,
                   special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                   initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    types = [3 if t.startswith("<|") else 1 for t in tokens]
    return _write_gguf(path, tokens, types, tokenizer_model="gpt2", tokenizer_pre=pre,
                       token_merges=merges, bos_token_id=1, eos_token_id=2, **fields)


SMALL_CORPUS = ["Hello world", " Hello  world ", "naïve café 😀 日本 ü", "", "  ", "42 + 7 = 49",
                "the theory\n\nof <|tool|> everything</s>", "<s>hi", "It's  we'LL   ",
                "<|im_start|>user\nhi<|im_end|>", "x\u00a0y\tz\r\n"]


@pytest.mark.parametrize("add_bos,add_space_prefix", [(None, None), (False, None),
                                                       (True, False)])
def test_sentencepiece_gguf_matches_transformers(tmp_path, add_bos, add_space_prefix):
    fields = {} if add_bos is None else {"add_bos_token": add_bos}
    bools = {} if add_space_prefix is None else {
        "tokenizer.ggml.add_space_prefix": add_space_prefix}
    path = _spm_gguf(tmp_path / "spm.gguf", bools=bools, **fields)
    mine = Tokenizer.from_path(path)
    ref = TokenizersBackend.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path))
    assert mine.bos_token_id == 1 and mine.all_special_ids == {0, 1, 2}
    assert (mine.encode("hi")[0] == 1) == (add_bos is not False)  # llama.cpp's default: add
    # transformers ignores add_space_prefix=false (it always prepends ▁ and strips a leading
    # space on decode); llama.cpp honors it and so do we. Text that starts with a space
    # encodes the same either way.
    prefix = " " if add_space_prefix is False else ""
    for text in SMALL_CORPUS:
        ids = mine.encode(prefix + text)
        assert ids == ref.encode(prefix + text), text
        if prefix and "<s>" not in text and "</s>" not in text:
            assert mine.decode(ids) == prefix + text
        for skip in [] if prefix else [True, False]:
            assert mine.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip)
    if add_space_prefix is False:
        ids = mine.encode("hello world", add_special_tokens=False)
        assert not mine.convert_ids_to_tokens(ids)[0].startswith("▁")
        assert mine.decode(ids) == "hello world"
    tokens = mine.convert_ids_to_tokens(mine.encode("😀", add_special_tokens=False))
    assert tokens[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]  # byte fallback
    tool = mine.token_to_id("<|tool|>")  # user-defined: matched whole, kept by decode
    assert mine.encode("a<|tool|>b", add_special_tokens=False)[1] == tool
    assert mine.decode([tool]) == "<|tool|>"


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2", "smollm"])
def test_byte_level_gguf_pre_tokenizers(tmp_path, pre):
    path = _byte_level_gguf(tmp_path / "bl.gguf", pre, add_bos_token=pre == "llama-bpe",
                            chat_template="{{ messages[0]['content'] }}")
    mine = Tokenizer.from_gguf(path)
    ref = TokenizersBackend.from_pretrained(str(tmp_path), gguf_file="bl.gguf")
    assert mine.chat_template == "{{ messages[0]['content'] }}"
    assert (mine.encode("hi")[0] == 1) == (pre == "llama-bpe")
    for text in SMALL_CORPUS + ["Hello world 12345 and 2024!", "aaaa1234567"]:
        ids = mine.encode(text)
        assert mine.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        if pre == "smollm" and any(c.isdigit() for c in text):
            continue  # transformers does not isolate digits (see DIGIT_AFTER_SPACES)
        if pre == "qwen2" and "ï" in text:
            continue  # Qwen2's tokenizer.json normalizes to NFC; transformers' GGUF path not
        assert ids == ref.encode(text), text
    tokens = mine.convert_ids_to_tokens(mine.encode("x 1234567", add_special_tokens=False))
    digit_runs = [len(t.lstrip("Ġ")) for t in tokens if any(c.isdigit() for c in t)]
    # How each family splits numbers before merging: in threes (Llama 3) or one by one.
    assert max(digit_runs) <= {"llama-bpe": 3, "qwen2": 1, "smollm": 1}.get(pre, 7)


def test_gguf_named_templates_and_end_of_turn(tmp_path):
    path = _byte_level_gguf(tmp_path / "t.gguf", "qwen2", eot_token_id=0, chat_template=[
        {"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}])
    tok = Tokenizer.from_gguf(path)
    assert tok.chat_templates == {"default": "D", "tool_use": "T"}
    assert tok.apply_chat_template([], tools=[{"name": "f"}]) == "T"
    assert tok.eos_token_ids == {0, 2}


def test_qwen2_gguf_normalizes_nfc(tmp_path):
    mine = Tokenizer.from_gguf(_byte_level_gguf(tmp_path / "q.gguf", "qwen2"))
    assert mine.encode("cafe\u0301") == mine.encode("café")


# ---- Hugging Face directories ---------------------------------------------------------------

def _byte_level_dir(folder, config: dict | None = None, files: dict | None = None) -> str:
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    rust.post_processor = processors.ByteLevel(trim_offsets=False)
    rust.train_from_iterator(TRAIN_TEXT, trainers.BpeTrainer(
        vocab_size=400, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|bos|>", "<|eos|>", "<｜end▁of▁turn｜>"]))
    return _save_dir(folder, rust, config, files)


def _sentencepiece_dir(folder, config: dict | None = None) -> str:
    """Llama-2 style tokenizer.json: BPE with byte fallback, Metaspace, BOS post-processor."""
    model = _train(pre_tokenizers.Metaspace(prepend_scheme="always"), 300)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=[tuple(m) for m in model["merges"]],
                                    unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    rust.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    rust.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                      decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    rust.add_special_tokens(["<unk>", "<s>", "</s>"])
    rust.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return _save_dir(folder, rust, {"bos_token": "<s>", "eos_token": "</s>",
                                    "unk_token": "<unk>", **(config or {})}, None)


def _save_dir(folder, rust, config: dict | None, files: dict | None) -> str:
    folder.mkdir(exist_ok=True)
    rust.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for name, content in (files or {}).items():
        path = folder / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(folder)


@pytest.mark.parametrize("config", [None, {"add_bos_token": False}, {"add_bos_token": True}])
def test_sentencepiece_dir(tmp_path, config):
    folder = _sentencepiece_dir(tmp_path / "spm", config)
    tok = Tokenizer.from_path(folder)
    ref = TokenizersBackend.from_pretrained(folder)
    # tokenizer_config.json's add_bos_token, when given, overrides the tokenizer.json
    # post-processor (as transformers 4's LlamaTokenizerFast did; transformers 5.24 keeps
    # adding the post-processor's BOS), else the post-processor decides.
    bos = (config or {}).get("add_bos_token", True)
    assert (tok.encode("hi")[0] == tok.bos_token_id == 1) == bos
    for text in SMALL_CORPUS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert tok.encode(text) == ([1] if bos else []) + ids
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.decode(tok.encode("naïve  😀 日本")) == "naïve  😀 日本"
    # Like Llama 2's tokenizer, a leading space is dropped: Metaspace reads it as the ▁ it
    # would have added, and the decoder strips that one.
    assert tok.decode(tok.encode(" x")) == "x"
    assert "<0xF0>" in tok.convert_ids_to_tokens(tok.encode("😀"))


def test_byte_level_dir_special_tokens_and_bos(tmp_path):
    bos = {"__type": "AddedToken", "content": "<|bos|>", "lstrip": False, "normalized": False,
           "rstrip": False, "single_word": False, "special": True}
    config = {"bos_token": bos, "eos_token": "<|eos|>",
              "add_bos_token": True,
              "chat_template": "{{ bos_token }}{{ messages[0].content }}"}
    folder = _byte_level_dir(tmp_path / "bl", config, {
        "special_tokens_map.json": {"pad_token": "<|endoftext|>"},
        "generation_config.json": {"eos_token_id": [2, 0]}})
    tok = Tokenizer.from_path(os.path.join(folder, "tokenizer.json"))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    assert tok.eos_token_ids == {0, 2} and {0, 1, 2, 3} <= tok.all_special_ids
    ids = tok.encode("héllo 😀")
    assert ids[0] == 1 and tok.decode(ids) == "héllo 😀"
    # transformers 5.24 ignores the config's add_bos_token here (see test_sentencepiece_dir).
    ref = TokenizersBackend.from_pretrained(folder)
    assert ids[1:] == ref.encode("héllo 😀", add_special_tokens=False)
    # A special token outside the byte alphabet survives the byte-level decoder.
    ids = tok.encode("a<｜end▁of▁turn｜>b", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == "a<｜end▁of▁turn｜>b"
    assert tok.decode(ids) == "ab"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|bos|>x"


def test_chat_template_sources(tmp_path):
    named = [{"name": "default", "template": "D{{ messages|length }}"},
             {"name": "tool_use", "template": "T{{ tools|length }}"}]
    tok = Tokenizer.from_path(_byte_level_dir(tmp_path / "a", {"chat_template": named}))
    msgs = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(msgs) == "D1"
    assert tok.apply_chat_template(msgs, tools=[{"name": "f"}, {"name": "g"}]) == "T2"
    assert tok.apply_chat_template(msgs, chat_template="tool_use", tools=[]) == "T0"
    assert tok.apply_chat_template(msgs, chat_template="C{{ x }}", x=5) == "C5"
    folder = _byte_level_dir(tmp_path / "b", {"chat_template": "old"}, {
        "chat_template.jinja": "new{{ add_generation_prompt }}",
        "additional_chat_templates/rag.jinja": "rag"})
    tok = Tokenizer.from_path(folder)
    assert tok.chat_template == "new{{ add_generation_prompt }}"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "newFalse"
    assert tok.apply_chat_template(msgs, chat_template="rag") == "rag"


def test_chat_template_helpers(smollm):
    template = (
        "{% for m in messages %}{% if m.role == 'stop' %}{% break %}{% endif %}"
        "{{ m | tojson }}\n{% endfor %}"
        "{% if strftime_now('%Y')|int < 2000 %}{{ raise_exception('clock') }}{% endif %}"
        "{% generation %}{{ eos_token }}{% endgeneration %}")
    msgs = [{"role": "user", "content": "Grüße 😀 <b>"}, {"role": "stop"}, {"role": "x"}]
    out = smollm.apply_chat_template(msgs, chat_template=template)
    assert out == '{"role": "user", "content": "Grüße 😀 <b>"}\n<|im_end|>'
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([msgs], chat_template=template, eos_token="<|im_end|>")
    assert rendered[0] == out  # transformers' renderer agrees


def test_chat_template_errors(smollm, tmp_path):
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(InvalidParameterError, match="roles must alternate"):
        smollm.apply_chat_template(msgs, chat_template="{{ raise_exception('roles must "
                                   "alternate') }}")
    with pytest.raises(InvalidParameterError, match="not valid jinja"):
        smollm.apply_chat_template(msgs, chat_template="{% for %}")
    with pytest.raises(InvalidParameterError):
        smollm.apply_chat_template("not a list")
    with pytest.raises(InvalidParameterError):  # content None + str in SmolLM2's template
        smollm.apply_chat_template([{"role": "user", "content": None}])
    with pytest.raises(InvalidParameterError):  # the sandbox refuses attribute escapes
        smollm.apply_chat_template(msgs, chat_template="{{ messages.__class__.__mro__ }}")
    bare = Tokenizer.from_path(_byte_level_dir(tmp_path / "bare", None))
    assert bare.chat_template is None and bare.bos_token_id is None
    with pytest.raises(InvalidParameterError, match="no chat template"):
        bare.apply_chat_template(msgs)
    with pytest.raises(InvalidParameterError):
        smollm.encode(None)


# ---- load errors ---------------------------------------------------------------------------

def test_load_errors(tmp_path, gguf_path):
    with pytest.raises(ModelNotFoundError):
        Tokenizer.from_path(tmp_path / "missing")
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_path(tmp_path)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelLoadError):
        Tokenizer.from_path(tmp_path / "notes.txt")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError):
        Tokenizer.from_path(bad)
    folder = _byte_level_dir(tmp_path / "badcfg", None)
    (tmp_path / "badcfg" / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ModelLoadError):
        Tokenizer.from_path(folder)
    with open(gguf_path, "rb") as f:
        head = f.read(200_000)  # cut inside the vocabulary
    for name, data in [("cut.gguf", head), ("junk.gguf", b"not a gguf file at all" * 10),
                       ("empty.gguf", b"")]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ModelLoadError):
            Tokenizer.from_path(tmp_path / name)
    no_vocab = gguf.GGUFWriter(str(tmp_path / "novocab.gguf"), "llama")
    for step in (no_vocab.write_header_to_file, no_vocab.write_kv_data_to_file,
                 no_vocab.write_tensors_to_file, no_vocab.close):
        step()
    with pytest.raises(ModelLoadError, match="no tokenizer vocabulary"):
        Tokenizer.from_gguf(tmp_path / "novocab.gguf")
    path = _write_gguf(tmp_path / "bert.gguf", ["a", "b"], [1, 1], tokenizer_model="bert")
    with pytest.raises(ModelLoadError, match="not supported"):
        Tokenizer.from_gguf(path)


def test_directory_with_only_a_gguf(tmp_path, gguf_path, smollm):
    os.symlink(gguf_path, tmp_path / "model.gguf")
    tok = Tokenizer.from_path(tmp_path)
    assert tok.encode("Hello 2024 😀") == smollm.encode("Hello 2024 😀")


def test_unknown_gguf_pre_tokenizer_is_refused(tmp_path):
    """A split kvflow does not know would give other ids than llama.cpp: refused, with
    the key, the supported values and the way out, instead of GPT-2 splitting."""
    path = _byte_level_gguf(tmp_path / "bl.gguf", "some-new-family")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.ggml\.pre\) 'some-new-family' is "
                       r"not supported \(supported: .*llama-bpe.*smollm.*--tokenizer"):
        Tokenizer.from_gguf(path)
