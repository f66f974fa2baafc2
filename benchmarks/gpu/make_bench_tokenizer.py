"""A real 128k-token byte-level BPE tokenizer for the 8B-shape benchmarks that need one
(constrained decoding: a grammar's mask fill scales with the vocabulary it walks).

No model hub is reachable from the dev or GPU machines, and the embedded model's 49k
tokenizer padded to Llama-3's 128,256 logits is not what a user's 8B model brings: its
padding ids made xgrammar's fill 6x slower than a real vocabulary would. The PyPI package
``mistral-common`` ships Mistral's Tekken vocabulary (tiktoken-style ranks over 150k byte
sequences, with its split pattern); this script takes its first 128,254 ranks, rebuilds
the BPE merges (transformers' TikTokenConverter) and adds ``<s>``/``</s>`` as ids 128,254
and 128,255, so the tokenizer is exactly as wide as the 8B shape's logits, with the end
of sequence at the top as in Llama 3. The chat template is SmolLM2's (ChatML), as text.

    pip download --no-deps mistral-common -d /tmp/mc
    python benchmarks/gpu/make_bench_tokenizer.py /tmp/mc/mistral_common-*.whl .gpu-carry/tok128k
    SO_TOKENIZER=.gpu-carry/tok128k bash benchmarks/gpu/run.sh structured

Needs ``transformers`` (the converter); not ``tiktoken`` (the ranks are read here).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import tempfile
import zipfile

TEKKEN = "mistral_common/data/tekken_240911.json"
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("wheel", help="a mistral-common wheel (pip download --no-deps)")
    p.add_argument("out", help="folder for tokenizer.json and tokenizer_config.json")
    p.add_argument("--vocab-size", type=int, default=128256, help="ids in all (logits)")
    ns = p.parse_args()

    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    with zipfile.ZipFile(ns.wheel) as z:
        tekken = json.loads(z.read(TEKKEN))
    n = ns.vocab_size - 2
    ranks = {base64.b64decode(e["token_bytes"]): e["rank"] for e in tekken["vocab"][:n]}
    assert sorted(ranks.values()) == list(range(n))

    class Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(_path: str) -> dict[bytes, int]:  # no tiktoken needed
            return ranks

    with tempfile.NamedTemporaryFile("w", suffix=".tiktoken") as f:
        tok = Converter(vocab_file=f.name, pattern=tekken["config"]["pattern"],
                        additional_special_tokens=[]).converted()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    assert tok.get_vocab_size() == ns.vocab_size and tok.token_to_id("</s>") == n + 1
    os.makedirs(ns.out, exist_ok=True)
    tok.save(os.path.join(ns.out, "tokenizer.json"))
    with open(os.path.join(ns.out, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHATML}, f)
    sample = tok.encode('{"name": "Ada", "age": 36}').tokens
    print(f"{ns.out}: {tok.get_vocab_size()} tokens, </s> = {n + 1}; {sample}")


if __name__ == "__main__":
    main()
