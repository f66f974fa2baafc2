"""The model's vocabulary as the grammar engine reads it (xgrammar's TokenizerInfo).

Built once per engine from the tokenizer the API process uses too (a Hugging Face
``tokenizer.json`` or a GGUF file's vocabulary rebuilt by ``kvflow.engine.tokenizer``),
so both sides agree on what every token id spells.
"""

from __future__ import annotations

from functools import lru_cache


def tokenizer_info(backend, vocab_size: int, eos_token_ids: list[int]):
    """xgrammar TokenizerInfo for a ``tokenizers.Tokenizer`` whose model has
    ``vocab_size`` logits (it may pad past the tokenizer's own size).

    The grammar sees the logits' ids cut at the tokenizer's own size. Padded ids spell
    nothing, so a constrained row never allows them (``apply_token_bitmask`` forbids
    what the bitmask does not cover); leaving them out keeps the bitmask, and its fill,
    the tokenizer's width: SmolLM2's 49k tokenizer padded to 128k logits filled 32
    JSON-schema rows in 4.9 ms with the padding in and 0.74 ms without (one thread of
    this project's 2-core dev machine)."""
    import xgrammar as xgr

    vocab = backend.get_vocab(with_added_tokens=True)  # token text -> id
    size = min(vocab_size, max(vocab.values()) + 1)
    encoded = [""] * size
    for text, idx in vocab.items():
        if idx < size:
            encoded[idx] = text
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(encoded, vocab_type=meta["vocab_type"],
                             vocab_size=size, stop_token_ids=list(eos_token_ids),
                             add_prefix_space=meta["add_prefix_space"])


@lru_cache(maxsize=4)
def load_tokenizer(tokenizer_path: str):
    """The tokenizer at ``tokenizer_path`` (cached per process)."""
    from kvflow.engine.tokenizer import Tokenizer

    return Tokenizer.from_path(tokenizer_path)


@lru_cache(maxsize=4)
def load_tokenizer_info(tokenizer_path: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
    """TokenizerInfo of the tokenizer at ``tokenizer_path`` (cached per process).

    The tokenizer module is the engine floor's, but it imports nothing above
    ``models/``; the worker reads it here so the sampling rank can build its own
    vocabulary from the config it already has (no tokenizer crosses a process)."""
    tok = load_tokenizer(tokenizer_path)
    eos = set(eos_token_ids)
    if tok.eos_token_id is not None:
        eos.add(tok.eos_token_id)
    return tokenizer_info(tok.backend, vocab_size, sorted(eos))
