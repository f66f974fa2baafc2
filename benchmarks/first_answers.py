"""How the embedded model's answers begin and end with the engine's defaults (issue 29).

Two workloads, each in a fresh engine per configuration (one subprocess each, so
environment switches such as KVFLOW_CPU_INT8_ACT apply):

- factual: nine questions of the README's kind, sent as chat with no sampling fields
  (the engine's defaults) or greedy; an answer is right when its first sentence names
  the expected fact. The llamacpp configurations ask llama-server (``--llama-server``,
  llama.cpp's OpenAI-compatible server with the file's own chat template, --jinja) the
  same questions on the same GGUF file: greedy, and with the model card's sampling.
- open: five open-ended prompts (poems, a story, lists) with no max_tokens; per prompt the
  time to finish, the tokens, the finish/stop reason and the share of repeated 4-grams
  (4-grams of output tokens that occurred earlier in the same output).

    python benchmarks/first_answers.py --save-result benchmarks/results/first-answers.json
    python benchmarks/first_answers.py --configs factual-llamacpp-greedy \
        factual-llamacpp-card --llama-server path/to/llama-server --save-result ...
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

FACTUAL = [
    ("What is the capital of France?", r"\bparis\b"),
    ("What is the chemical symbol for water?", r"\bh2o\b|\bh₂o\b"),
    ("What is the largest planet in our solar system?", r"\bjupiter\b"),
    ("How many days are there in a week?", r"\b(7|seven)\b"),
    ("Who wrote Romeo and Juliet?", r"\bshakespeare\b"),
    ("At what temperature in Celsius does water boil at sea level?", r"\b100\b"),
    ("What is the capital of Japan?", r"\btokyo\b"),
    ("How many legs does a spider have?", r"\b(8|eight)\b"),
    ("What gas do plants absorb from the air for photosynthesis?",
     r"carbon dioxide|\bco2\b|\bco₂\b"),
]
OPEN = [
    "Write a short poem about the sea.",
    "Write a haiku about autumn leaves.",
    "Tell me a short story about a robot who learns to paint.",
    "List some fun things to do on a rainy day.",
    "Write a poem about the moon and the stars.",
]


def first_sentence(text: str) -> str:
    text = text.strip()
    m = re.search(r"[.!?\n]", text[1:])
    return text if m is None else text[: m.start() + 2]


def repeated_4gram_share(ids: list[int]) -> float:
    seen, repeated, total = set(), 0, 0
    for i in range(len(ids) - 3):
        g = tuple(ids[i:i + 4])
        total += 1
        repeated += g in seen
        seen.add(g)
    return repeated / total if total else 0.0


def factual_rows(answers: list[str]) -> dict:
    rows = []
    for (q, pattern), text in zip(FACTUAL, answers):
        first = first_sentence(text)
        rows.append({"question": q, "first_sentence": first,
                     "right": re.search(pattern, first.lower()) is not None})
    return {"right": sum(r["right"] for r in rows), "answers": rows}


def llama_server_worker(spec: dict, binary: str) -> dict:
    """The factual questions to llama-server on the embedded model's file: one server
    (2 threads, one slot), the questions one after another, 48 tokens at most."""
    import httpx

    from kvflow.distributed.launch import free_port
    from kvflow.models.registry import embedded_model_path

    port = free_port()
    proc = subprocess.Popen(
        [binary, "-m", embedded_model_path("smollm2-135m"), "--host", "127.0.0.1",
         "--port", str(port), "-c", str(spec["engine"]["max_model_len"]), "-t", "2",
         "-np", "1", "--jinja"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("llama-server did not start")
            time.sleep(0.5)
        start = time.perf_counter()
        answers = []
        for q, _ in FACTUAL:
            r = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
                "messages": [{"role": "user", "content": q}], "max_tokens": 48,
                **spec["sampling"]})
            r.raise_for_status()
            answers.append(r.json()["choices"][0]["message"]["content"])
        seconds = round(time.perf_counter() - start, 2)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {"name": spec["name"], "engine": {"server": "llama-server",
                                             **spec["engine"]},
            "sampling": spec["sampling"], "seconds": seconds, **factual_rows(answers)}


def worker(spec: dict) -> dict:
    from kvflow import LLM, SamplingParams

    if spec.get("server") == "llama-server":
        return llama_server_worker(spec, spec["binary"])
    llm = LLM("smollm2-135m", **spec["engine"])
    out: dict = {"name": spec["name"], "engine": spec["engine"], "env": spec["env"]}
    if spec["workload"] == "factual":
        params = SamplingParams(max_tokens=48, **spec["sampling"])
        start = time.perf_counter()
        res = llm.chat([[{"role": "user", "content": q}] for q, _ in FACTUAL], params,
                       use_tqdm=False)
        out["seconds"] = round(time.perf_counter() - start, 2)
        out.update(factual_rows([r.outputs[0].text for r in res]))
        return out
    rows = []
    for prompt in OPEN:  # one at a time: the time to finish is the user's wait
        params = SamplingParams(max_tokens=None, **spec["sampling"])
        start = time.perf_counter()
        r = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
        c = r.outputs[0]
        rows.append({"prompt": prompt, "seconds": round(time.perf_counter() - start, 2),
                     "tokens": len(c.token_ids), "finish_reason": c.finish_reason,
                     "stop_reason": c.stop_reason,
                     "repeated_4gram_share": round(repeated_4gram_share(c.token_ids), 3),
                     "text_head": c.text[:160]})
    out["prompts"] = rows
    out["total_seconds"] = round(sum(r["seconds"] for r in rows), 2)
    out["mean_repeated_4gram_share"] = round(
        sum(r["repeated_4gram_share"] for r in rows) / len(rows), 3)
    return out


CONFIGS = {
    # Factual: the default path (GGUF blocks, the C++ step's int8 activations), float32
    # activations in the same GEMV, and dense float32 weights; defaults vs greedy.
    "factual-int8act-defaults": dict(workload="factual", env={}, engine={},
                                     sampling={}),
    "factual-int8act-greedy": dict(workload="factual", env={}, engine={},
                                   sampling={"temperature": 0.0}),
    "factual-f32act-defaults": dict(workload="factual", env={"KVFLOW_CPU_INT8_ACT": "0"},
                                    engine={}, sampling={}),
    "factual-f32act-greedy": dict(workload="factual", env={"KVFLOW_CPU_INT8_ACT": "0"},
                                  engine={}, sampling={"temperature": 0.0}),
    "factual-dense-defaults": dict(workload="factual", env={},
                                   engine={"quantization": "none"}, sampling={}),
    "factual-dense-greedy": dict(workload="factual", env={},
                                 engine={"quantization": "none"},
                                 sampling={"temperature": 0.0}),
    # llama.cpp on the same file and questions: greedy, and the model card's sampling
    # (temperature 0.2, top_p 0.9; a fixed seed, though not the same random stream).
    "factual-llamacpp-greedy": dict(workload="factual", env={}, engine={},
                                    server="llama-server", sampling={"temperature": 0.0}),
    "factual-llamacpp-card": dict(workload="factual", env={}, engine={},
                                  server="llama-server",
                                  sampling={"temperature": 0.2, "top_p": 0.9, "seed": 0}),
    # Open-ended: before (no cap: up to the context, here 2048; no guard) and after (the
    # engine's defaults: the registry's 1024 cap and the repetition guard).
    "open-before": dict(workload="open", env={},
                        engine={"max_tokens_default": 0, "repetition_guard": 0},
                        sampling={}),
    "open-after": dict(workload="open", env={}, engine={}, sampling={}),
}


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--save-result", required=True)
    p.add_argument("--notes", default="")
    p.add_argument("--llama-server", default=None,
                   help="llama-server binary for the llamacpp configurations")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.worker:
        print(json.dumps(worker(json.loads(ns.worker))))
        return 0
    from kvflow.bench.machine import save_result

    runs = []
    for name in ns.configs:
        spec = {"name": name, **CONFIGS[name]}
        if spec.get("server") == "llama-server":
            if not ns.llama_server:
                p.error(f"{name} needs --llama-server")
            spec["binary"] = ns.llama_server
        spec["engine"] = {"max_model_len": ns.max_model_len, "kv_cache_memory": "512MiB",
                          **spec["engine"]}
        env = {**os.environ, "KVFLOW_NO_PROGRESS": "1", **spec["env"]}
        proc = subprocess.run([sys.executable, __file__, "--save-result", "-",
                               "--worker", json.dumps(spec)], capture_output=True,
                              text=True, env=env, check=True)
        run = json.loads(proc.stdout.strip().splitlines()[-1])
        print(json.dumps({k: v for k, v in run.items() if k not in ("answers", "prompts")}),
              flush=True)
        runs.append(run)
    save_result(ns.save_result, {"benchmark": "first_answers", "notes": ns.notes,
                                 "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
