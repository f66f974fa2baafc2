"""Tool calling: the cost of parsing streamed output for tool calls, and the validity of
calls the grammar engine enforces (tool_choice "required").

  python benchmarks/tool_calls.py parse --out benchmarks/results/tool-parse-overhead.json
  python benchmarks/tool_calls.py stream --out ...   # a server, auto vs. plain, alternated
  python benchmarks/tool_calls.py validity --requests 50 --out ...

parse: per-token cost of the chat output parsers (hermes tools, + qwen3 reasoning) over
real token deltas of the embedded tokenizer, against building the plain content delta.
stream: one kvflow serve (embedded model); the same rendered prompt streamed with tools
(tool_choice auto: the parser runs on every delta) and without (the default tool prompt
sent as the system message, so the prompt is identical), runs alternated.
validity: tool_choice "required" over the tool set at temperature 1; every call's
arguments validated with jsonschema.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search_flights", "description": "Flights between two airports",
        "parameters": {"type": "object", "properties": {
            "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
            "cabin": {"type": "string", "enum": ["economy", "business", "first"]}},
            "required": ["origin", "destination", "passengers"],
            "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add_event", "description": "Add a calendar event",
        "parameters": {"type": "object", "properties": {
            "title": {"type": "string", "maxLength": 60},
            "attendees": {"type": "array", "items": {"type": "string", "maxLength": 30},
                          "maxItems": 4},
            "all_day": {"type": "boolean"},
            "reminder": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 1440},
                                   {"type": "null"}]}},
            "required": ["title", "all_day"], "additionalProperties": False}}},
]
PROMPTS = ["What's the weather in Paris?", "Find me a flight from SFO to JFK for two.",
           "Put lunch with Ana on my calendar.", "Is it cold in Oslo right now?",
           "Book business class LHR to NRT.", "Remind me about the dentist tomorrow."]

CONTENT = ("Paris is the capital of France. It is known for the Eiffel Tower, the Louvre, "
           "and its cafés. The city has about two million inhabitants, and the greater "
           "metropolitan area more than twelve million. ") * 3
CALLS = ("I'll look that up.\n<tool_call>\n" + json.dumps(
    {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}})
    + "\n</tool_call>\n<tool_call>\n" + json.dumps(
    {"name": "search_flights", "arguments": {"origin": "CDG", "destination": "JFK",
                                             "passengers": 2}}) + "\n</tool_call>")


def _deltas(tok, text: str) -> list[str]:
    """The per-token text deltas an incremental detokenizer sends for ``text``."""
    ids = tok.encode(text, add_special_tokens=False)
    out, prev = [], ""
    for i in range(1, len(ids) + 1):
        cur = tok.decode(ids[:i])
        out.append(cur[len(prev):])
        prev = cur
    return out


def bench_parse(ns) -> dict:
    from kvflow.engine.tokenizer import Tokenizer
    from kvflow.entrypoints.openai.chat_parsing import ChoiceParser
    from kvflow.entrypoints.reasoning_parsers import Qwen3ReasoningParser
    from kvflow.entrypoints.tool_parsers import HermesToolParser
    from kvflow.models.registry import embedded_model_path

    tok = Tokenizer.from_gguf(embedded_model_path("smollm2-135m"))
    texts = {"content": CONTENT, "tool_calls": CALLS,
             "reasoning+tool_calls": "<think>\nThe user wants weather.\n</think>\n\n" + CALLS}
    variants = {
        "plain": lambda: None,
        "hermes": lambda: ChoiceParser(None, HermesToolParser()),
        "qwen3+hermes": lambda: ChoiceParser(Qwen3ReasoningParser(""), HermesToolParser()),
    }
    rows = []
    for tname, text in texts.items():
        deltas = _deltas(tok, text)
        for vname, make in variants.items():
            samples = []
            for _ in range(ns.repeats):
                t0 = time.perf_counter()
                p = make()
                for d in deltas[:-1]:
                    delta = {"content": d} if p is None else p.feed(d)
                delta = {"content": deltas[-1]} if p is None else p.finish(deltas[-1])
                samples.append((time.perf_counter() - t0) / len(deltas))
            del delta
            rows.append({"text": tname, "tokens": len(deltas), "parser": vname,
                         "us_per_token_median": round(statistics.median(samples) * 1e6, 3),
                         "us_per_token_min": round(min(samples) * 1e6, 3)})
            print(rows[-1])
    return {"benchmark": "tool-call parse overhead per streamed token", "rows": rows}


def _server(extra: list[str] | None = None):
    from server_utils import RemoteServer

    return RemoteServer(["--max-model-len", "2048", *(extra or [])])


def bench_stream(ns) -> dict:
    from kvflow.entrypoints.tools import default_tool_prompt

    srv = _server()
    try:
        client = srv.openai_client()
        user = [{"role": "user", "content": "Write a short paragraph about Paris."}]
        plain = [{"role": "system", "content": default_tool_prompt(TOOLS)}] + user
        runs: dict[str, list[dict]] = {"auto": [], "plain": []}
        for i in range(ns.runs * 2):
            kind = ("auto", "plain")[i % 2]
            t0 = time.perf_counter()
            stream = client.chat.completions.create(
                model="smollm2-135m", messages=user if kind == "auto" else plain,
                tools=TOOLS if kind == "auto" else None, max_tokens=ns.max_tokens,
                temperature=0, stream=True, stream_options={"include_usage": True})
            usage, first = None, None
            for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - t0
                usage = chunk.usage or usage
            total = time.perf_counter() - t0
            runs[kind].append({"seconds": round(total, 4), "ttft_s": round(first or 0, 4),
                               "prompt_tokens": usage.prompt_tokens,
                               "completion_tokens": usage.completion_tokens,
                               "tokens_per_s": round(usage.completion_tokens / total, 2)})
            print(kind, runs[kind][-1])
        med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
        assert {r["prompt_tokens"] for r in runs["auto"]} == \
            {r["prompt_tokens"] for r in runs["plain"]}, "prompts differ"
        return {"benchmark": "streamed chat, tool_choice auto (parsed) vs. the same prompt "
                             "without tools (not parsed)", "runs": runs,
                "median_tokens_per_s": med,
                "auto_over_plain": round(med["auto"] / med["plain"], 4)}
    finally:
        srv.cleanup()


def bench_validity(ns) -> dict:
    import jsonschema

    srv = _server()
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    try:
        client = srv.openai_client()
        total = valid = 0
        failures = []
        t0 = time.perf_counter()
        for i in range(ns.requests):
            r = client.chat.completions.create(
                model="smollm2-135m", tools=TOOLS, tool_choice="required",
                messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                max_tokens=ns.max_tokens, temperature=1.0, seed=i)
            choice = r.choices[0]
            calls = choice.message.tool_calls or []
            total += 1
            try:
                assert calls and choice.finish_reason == "tool_calls"
                for c in calls:
                    jsonschema.validate(json.loads(c.function.arguments),
                                        schemas[c.function.name])
                valid += 1
            except (AssertionError, ValueError, KeyError,
                    jsonschema.ValidationError) as e:
                failures.append({"request": i, "finish_reason": choice.finish_reason,
                                 "error": str(e)[:200],
                                 "content": choice.message.content})
        return {"benchmark": "tool_choice required: calls whose arguments validate",
                "requests": total, "valid": valid,
                "valid_fraction": valid / total if total else None,
                "seconds": round(time.perf_counter() - t0, 2), "failures": failures[:10]}
    finally:
        srv.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["parse", "stream", "validity"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--notes", default="")
    ns = ap.parse_args()
    from kvflow.bench.machine import save_result

    result = {"parse": bench_parse, "stream": bench_stream,
              "validity": bench_validity}[ns.what](ns)
    result["notes"] = ns.notes
    stamped = save_result(None, result)
    stamped["command"] = "python benchmarks/tool_calls.py " + " ".join(sys.argv[1:])
    if ns.out:
        os.makedirs(os.path.dirname(os.path.abspath(ns.out)), exist_ok=True)
        with open(ns.out, "w") as f:
            json.dump(stamped, f, indent=2)
        print(f"saved {ns.out}")


if __name__ == "__main__":
    main()
