"""Write tests/data/smollm2_hf_greedy.json: Hugging Face transformers' greedy answers
(float32, the embedded GGUF file dequantized) to the parity test's prompts.

CI compares kvflow with these stored tokens and regenerates the shortest answer live;
``scripts/test_full.sh -m slow`` regenerates all of them (test_stored_reference_is_hf's).
Run this again after a transformers or tokenizer change that moves the answers:

    .venv/bin/python scripts/smollm2_hf_reference.py
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data", "smollm2_hf_greedy.json")


def hf_greedy(prompt_ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    """One prompt at a time (no padding), as the engine is compared with."""
    import torch
    import transformers

    from kvflow.models.registry import embedded_model_path

    path = embedded_model_path("smollm2-135m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            mask = torch.ones(1, len(ids), dtype=torch.long)
            out = hf.generate(torch.tensor([ids]), attention_mask=mask,
                              max_new_tokens=new_tokens, do_sample=False, top_p=None,
                              top_k=None, temperature=None)
            outs.append(out[0, len(ids):].tolist())
    return outs


def prompt_ids(prompts: list[str]) -> list[list[int]]:
    from kvflow.engine.tokenizer import Tokenizer
    from kvflow.models.registry import embedded_model_path

    tok = Tokenizer.from_path(embedded_model_path("smollm2-135m"))
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                       add_special_tokens=False) for p in prompts]


def main() -> None:
    import transformers

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_smollm2_parity import NEW_TOKENS, PROMPTS

    ids = prompt_ids(PROMPTS)
    data = {"generator": "scripts/smollm2_hf_reference.py",
            "transformers": transformers.__version__, "new_tokens": NEW_TOKENS,
            "prompts": PROMPTS, "prompt_ids": ids, "tokens": hf_greedy(ids, NEW_TOKENS)}
    with open(DATA, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"wrote {DATA}")


if __name__ == "__main__":
    main()
