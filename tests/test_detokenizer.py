"""IncrementalDetokenizer: streamed text equals a full decode, multi-byte characters are never
shown half-made, stop strings cut the text and are never shown early."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from kvflow.engine.detokenizer import IncrementalDetokenizer
from kvflow.engine.tokenizer import Tokenizer
from kvflow.errors import ModelNotFoundError

TEXTS = [
    "Hello world", "The quick brown fox jumps over the lazy dog.", "a", " leading space",
    "😀", "emoji 😀👍🏽🇺🇸 and a family 👨‍👩‍👧‍👦!", "日本語のテキストです。", "中文：你好，世界",
    "naïve café résumé Ångström", "e\u0301 combining", "mixed 日本 😀 text 123\n\nnew  lines",
    "def f(x):\n    return x ** 2\n", "Привет, мир", "🎉" * 5, "tab\tand\u00a0nbsp",
]
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    from kvflow.models.registry import embedded_model_path

    try:
        return Tokenizer.from_gguf(embedded_model_path("smollm2-135m"))
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    """Llama-2 style: BPE pieces learned from English only, so everything else falls back to
    <0xNN> byte tokens; ▁ marks spaces and decode strips the space it prepended."""
    trainer = RustTokenizer(models.BPE())
    trainer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    trainer.train_from_iterator(["the quick brown fox jumps over the lazy dog",
                                 "hello world, hello there", "STOP and go"] * 10,
                                trainers.BpeTrainer(vocab_size=120, show_progress=False))
    model = json.loads(trainer.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    backend = RustTokenizer(models.BPE(vocab=vocab, merges=[tuple(m) for m in model["merges"]],
                                       unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return Tokenizer(backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                     add_bos_token=True)


@pytest.fixture(params=["smollm", "spm"])
def tok(request) -> Tokenizer:
    return request.getfixturevalue(request.param)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int] | None = None,
           ) -> tuple[list[str], str | None]:
    """Feed ids (one at a time, or in the given chunk sizes); returns the deltas and stop."""
    deltas, matched, i, sizes = [], None, 0, iter(chunks or [])
    while i < len(ids) and matched is None:
        n = next(sizes, 1)
        matched = detok.update(ids[i:i + n])
        i += n
        deltas.append(detok.get_next_output_text(finished=matched is not None, delta=True))
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas, matched


def random_chunks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 5) for _ in range(n)]


# ---- text equals a full decode ------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_deltas_equal_full_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    for chunks in [None, random_chunks(hash(text) % 1000, len(ids))]:
        detok = IncrementalDetokenizer(tok, [])
        deltas, _ = stream(detok, ids, chunks)
        assert "".join(deltas) == full == detok.output_text
        assert not any(REPLACEMENT in d for d in deltas)
        assert detok.output_token_ids == ids and detok.num_output_tokens == len(ids)


@pytest.mark.parametrize("text", TEXTS)
def test_prompt_gives_context(tok, text):
    prompt = tok.encode("Question: say something. Answer:")
    ids = tok.encode(" " + text, add_special_tokens=False)
    deltas, _ = stream(IncrementalDetokenizer(tok, prompt), ids)
    before, after = tok.decode(prompt), tok.decode(prompt + ids)
    assert after.startswith(before)
    assert "".join(deltas) == after[len(before):]
    assert "".join(deltas).startswith(" ")  # the space a bare decode would drop (spm) is kept


def test_split_character_waits_for_its_last_byte(spm):
    ids = spm.encode("hello😀", add_special_tokens=False)
    assert spm.convert_ids_to_tokens(ids)[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    detok = IncrementalDetokenizer(spm, spm.encode("x"))
    deltas = []
    for i in ids:
        detok.update([i])
        deltas.append(detok.get_next_output_text(False, True))
    assert "".join(deltas[:-4]) == " hello" and deltas[-4:] == ["", "", "", "😀"]


def test_incomplete_tail_is_released_at_finish(tok):
    ids = tok.encode("ok 😀", add_special_tokens=False)[:-1]  # the emoji's last byte is missing
    full = tok.decode(ids)
    assert full.endswith(REPLACEMENT)
    deltas, _ = stream(IncrementalDetokenizer(tok, []), ids)
    assert REPLACEMENT not in "".join(deltas[:-1])
    assert "".join(deltas) == full


def test_invalid_bytes_show_as_in_a_full_decode(spm):
    ids = [spm.token_to_id("<0x80>"), *spm.encode("x", add_special_tokens=False)]
    deltas, _ = stream(IncrementalDetokenizer(spm, []), ids)
    assert "".join(deltas) == spm.decode(ids) == REPLACEMENT + " x"


def test_special_tokens(smollm):
    ids = smollm.encode("<|im_start|>assistant\nHi there<|im_end|>")
    for skip, spaces in [(True, True), (False, False), (False, True)]:
        detok = IncrementalDetokenizer(smollm, [], skip_special_tokens=skip,
                                       spaces_between_special_tokens=spaces)
        deltas, _ = stream(detok, ids, random_chunks(1, len(ids)))
        assert "".join(deltas) == smollm.decode(ids, skip_special_tokens=skip,
                                                spaces_between_special_tokens=spaces)
    assert smollm.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=True) \
        == "<|im_start|> assistant\nHi there <|im_end|>"


def test_cumulative_output(tok):
    ids = tok.encode("Hello 😀 world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    seen = []
    for i in ids:
        detok.update([i])
        seen.append(detok.get_next_output_text(finished=False, delta=False))
    seen.append(detok.get_next_output_text(finished=True, delta=False))
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))
    assert seen[-1] == tok.decode(ids)


def test_work_per_token_is_bounded(smollm):
    """Each token decodes a short window, never the whole output."""
    lengths: list[int] = []

    class Spy:
        backend = None  # forces the detokenizer through decode() below

        def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=False):
            lengths.append(len(ids))
            return smollm.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = smollm.encode("Streaming text with emoji 😀 and 日本語, " * 40, add_special_tokens=False)
    deltas, _ = stream(IncrementalDetokenizer(Spy(), list(range(100, 150))), ids)
    assert "".join(deltas) == smollm.decode(ids)
    assert len(ids) > 400 and max(lengths) <= 12 and len(lengths) < 1.5 * len(ids)


# ---- stop strings ---------------------------------------------------------------------------

def run_stop(tok, text, stop, chunks=None, **kw):
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=stop, **kw)
    deltas, matched = stream(detok, ids, chunks)
    assert "".join(deltas) == detok.output_text
    return detok, matched


@pytest.mark.parametrize("text,stop,expected", [
    ("STOP and more", ["STOP"], ""),
    ("Hello STOP world", ["STOP"], "Hello "),
    ("Hello world STOP", ["STOP"], "Hello world "),
    ("Hello world", ["STOP"], "Hello world"),
    ("Hello world", ["world", "lo w"], "Hel"),  # the match that ends first wins
    ("Hello world", ["o", "ll"], "He"),
    ("abc😀def", ["😀"], "abc"),
    ("日本語のテキスト", ["のテ"], "日本語"),
    ("one\n\ntwo", ["\n\n"], "one"),
])
def test_stop_strings(tok, text, stop, expected):
    for chunks in [None, random_chunks(7, 50)]:
        detok, matched = run_stop(tok, text, stop, chunks)
        assert detok.output_text == expected
        assert (matched is None) == (expected == text)
        assert detok.stop_reason == matched
        if matched is not None:
            detok, matched = run_stop(tok, text, stop, chunks, include_stop_str_in_output=True)
            assert detok.output_text == expected + matched


def test_stop_string_spanning_tokens(smollm):
    text = "The quick brown fox jumps over the lazy dog"
    ids = smollm.encode(text, add_special_tokens=False)
    pieces = [smollm.decode([i]) for i in ids]
    stop = pieces[3][-2:] + pieces[4][:2]  # straddles the boundary of tokens 3 and 4
    detok, matched = run_stop(smollm, text, [stop])
    assert matched == stop and detok.output_text == text[:text.index(stop)]
    assert detok.output_token_ids == ids[:5]  # the tokens after the match are dropped
    assert detok.update(ids[5:]) is None and detok.output_token_ids == ids[:5]


def test_tokens_after_a_match_are_ignored(smollm):
    ids = smollm.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm, [], stop=["two"])
    assert detok.update(ids) == "two"
    assert detok.output_text == "one " and detok.output_token_ids == ids[:2]
    assert detok.get_next_output_text(finished=False, delta=True) == "one "


def test_min_tokens(smollm):
    text = "stop here, then stop again"
    n = len(smollm.encode("stop here, then", add_special_tokens=False))
    detok, matched = run_stop(smollm, text, ["stop"], min_tokens=n)
    assert matched == "stop" and detok.output_text == "stop here, then "
    detok, matched = run_stop(smollm, text, ["stop"], min_tokens=100)
    assert matched is None and detok.output_text == text


def test_holdback_while_running(smollm):
    ids = smollm.encode("abcdefgh", add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm, [], stop=["xyz1", "q"])
    detok.update(ids)  # the last 3 characters could still start "xyz1"
    assert detok.get_next_output_text(finished=False, delta=True) == "abcde"
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    assert detok.get_next_output_text(finished=True, delta=True) == "fgh"
    cumulative = IncrementalDetokenizer(smollm, [], stop=["xyz1", "q"])
    cumulative.update(ids)
    assert cumulative.get_next_output_text(finished=False, delta=False) == "abcde"
    assert cumulative.get_next_output_text(finished=True, delta=False) == "abcdefgh"
    kept = IncrementalDetokenizer(smollm, [], stop=["xyz1"], include_stop_str_in_output=True)
    kept.update(ids)  # a kept stop string is never taken back: nothing to hold
    assert kept.get_next_output_text(finished=False, delta=True) == "abcdefgh"


ALPHABET = "ab \n😀é日"


def reference_cut(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    """The text read character by character: the first stop string to end cuts it."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stop if text[:end].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return (text[:end] if include else text[:end - len(s)]), s
    return text, None


@settings(max_examples=150, deadline=None)
@given(text=st.text(ALPHABET, max_size=30),
       stop=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
       include=st.booleans(),
       chunks=st.lists(st.integers(1, 6), max_size=30))
def test_stop_strings_property(smollm, text, stop, include, chunks):
    ids = smollm.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm, [], stop=stop, include_stop_str_in_output=include)
    deltas, matched = stream(detok, ids, chunks)
    expected, expected_stop = reference_cut(smollm.decode(ids), stop, include)
    assert detok.output_text == expected and matched == expected_stop
    shown = ""
    for d in deltas:  # nothing shown is ever taken back, so no stop string shows early
        shown += d
        assert expected.startswith(shown)
    assert shown == expected
