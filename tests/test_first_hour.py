"""What a newcomer trips on in the first hour (issue 29): abbreviated flags, the chat
template flag and request field, a port in use, URLs without a scheme, and the server's
length defaults and repetition guard seen through the official OpenAI client."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import pytest

from kvflow.cli import build_parser
from kvflow.engine.args import EngineArgs, read_chat_template
from kvflow.errors import InvalidParameterError

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_no_parser_takes_abbreviated_flags(capsys):
    parsers = list(_parsers(build_parser()))
    assert len(parsers) > 10 and all(not p.allow_abbrev for p in parsers)
    # The traps: --max-tok must not become --max-tokens(-default), nor
    # --chat-templ become --chat-template-timeout.
    for argv in (["generate", "--max-tok", "5"], ["serve", "--max-tokens", "100"],
                 ["serve", "--chat-templ", "x"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        assert e.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err
    ns = build_parser().parse_args(["generate", "--max-tokens", "5"])
    assert ns.max_tokens == 5 and ns.temperature is None  # unset: the model's default


def test_chat_template_flag_file_or_inline(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert read_chat_template(str(path)) == TEMPLATE
    assert read_chat_template(TEMPLATE) == TEMPLATE
    assert read_chat_template(None) is None
    with pytest.raises(InvalidParameterError, match="chat_template .* not a readable file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    cfg = EngineArgs(chat_template=str(path)).create_engine_config()
    assert cfg.model.chat_template == TEMPLATE
    from kvflow.engine.llm_engine import load_tokenizer

    tok = load_tokenizer(cfg)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # A request's own template wins; one that does not compile is the client's error.
    own = tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                  chat_template="Q: {{ messages[0].content }}")
    assert own == "Q: Hi"
    with pytest.raises(InvalidParameterError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                chat_template="{% for %}")


def test_port_in_use_fails_before_the_engine_starts():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "kvflow.cli", "serve", "--port",
                               str(port)], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "KVFLOW_NO_PROGRESS": "1"})
    elapsed = time.monotonic() - start
    assert proc.returncode == 3, proc.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr
    assert "engine core" not in proc.stderr  # nothing was started
    assert elapsed < 60


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_request_chat_template_and_repetition_guard(client, server):
    # A template that makes the prompt plain text; greedy decoding with the end tokens
    # banned falls into a loop, and the guard ends it with its own stop_reason.
    loop = "one two three four five six seven eight nine ten " * 8
    no_end = {"0": -100, "1": -100, "2": -100}
    r = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": loop}],
        temperature=0, max_tokens=300, logit_bias=no_end,
        extra_body={"chat_template": "{{ messages[0].content }}", "repetition_guard": 32})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == "repetition"
    assert r.usage.completion_tokens < 300
    # The same with the guard off runs to max_tokens.
    off = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": loop}],
        temperature=0, max_tokens=120, logit_bias=no_end,
        extra_body={"chat_template": "{{ messages[0].content }}", "repetition_guard": 0})
    assert off.choices[0].finish_reason == "length"
    import openai

    with pytest.raises(openai.BadRequestError, match="chat template"):
        client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "x"}],
            max_tokens=2, extra_body={"chat_template": "{% for %}"})
    assert "repetition guard 64 tokens" in server.log()


def test_chat_loop_quits_only_when_asked_and_ctrl_c_stops_a_reply(capsys):
    from kvflow.entrypoints.chat_client import run_chat_loop

    lines = iter(["first", "", "   ", "second", "third", "/quit", "never read"])
    asked: list[list[dict]] = []

    def read() -> str:
        return next(lines)

    def respond(history: list[dict]) -> str | None:
        asked.append([dict(m) for m in history])
        if history[-1]["content"] == "second":
            raise KeyboardInterrupt  # Ctrl-C during the reply
        return f"re: {history[-1]['content']}"

    assert run_chat_loop("sys", "test", respond, read) == 0
    assert [a[-1]["content"] for a in asked] == ["first", "second", "third"]
    # The stopped turn is dropped; the chat goes on with the rest of the history.
    assert asked[2] == [{"role": "system", "content": "sys"},
                        {"role": "user", "content": "first"},
                        {"role": "assistant", "content": "re: first"},
                        {"role": "user", "content": "third"}]
    assert "[reply stopped]" in capsys.readouterr().err

    def eof() -> str:
        raise EOFError  # Ctrl-D

    assert run_chat_loop(None, "test", respond, eof) == 0


def test_docs_page_works_offline(server):
    import httpx

    page = httpx.get(f"{server.url}/docs", timeout=30).text
    assert "cdn.jsdelivr" not in page and "/docs/assets/swagger-ui-bundle.js" in page
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
        r = httpx.get(f"{server.url}/docs/assets/{asset}", timeout=30)
        assert r.status_code == 200 and len(r.content) > 10_000


def test_schema_states_what_the_server_refuses():
    """Bodies the fuzzer found schema-valid but refused: the published schema now says
    so (checked with a JSON Schema validator against the OpenAPI document's models)."""
    import jsonschema

    from kvflow.entrypoints.openai.protocol import request_models

    models = request_models()
    by_name = {"CompletionRequest": models.completion, "ChatCompletionRequest": models.chat,
               "DetokenizeRequest": models.detokenize}

    def valid(name: str, body: dict) -> bool:
        schema = by_name[name].model_json_schema()
        return jsonschema.Draft202012Validator(schema).is_valid(body)

    assert not valid("CompletionRequest", {"prompt": ""})
    assert not valid("CompletionRequest", {"prompt": ["a", ""]})
    assert valid("CompletionRequest", {"prompt": "a"})
    assert not valid("ChatCompletionRequest", {"messages": [{"role": "tool"}]})
    assert not valid("ChatCompletionRequest",
                     {"messages": [{"role": "user", "content": None}]})
    assert valid("ChatCompletionRequest", {"messages": [{"role": "user", "content": "x"}]})
    assert valid("ChatCompletionRequest", {"messages": [
        {"role": "assistant", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]})
    # An integral float is an integer to JSON Schema, so the server takes it too.
    assert valid("DetokenizeRequest", {"tokens": [1069.0]})
    assert models.detokenize.model_validate({"tokens": [1069.0]}).tokens == [1069]
    with pytest.raises(Exception):
        models.detokenize.model_validate({"tokens": [1069.5]})


def test_bench_serve_warns_on_a_warm_cache_and_fresh_prompts_avoid_it(server, tmp_path,
                                                                       capsys):
    import json

    from kvflow.cli import main

    def run(*extra: str) -> dict:
        out = tmp_path / "r.json"
        assert main(["bench", "serve", "--base-url", server.url, "--num-prompts", "3",
                     "--input-len", "64", "--output-len", "2", "--seed", "777",
                     "--save-result", str(out), *extra]) == 0
        return json.loads(out.read_text())

    run()
    capsys.readouterr()
    again = run()  # the same prompts again: found in the prefix cache, and said so
    assert again["server_prefix_cache_hit_rate"] > 0.7
    assert "prefix cache" in capsys.readouterr().err
    fresh = run("--fresh-prompts")  # a new seed, warm-up included: nothing cached
    assert fresh["server_prefix_cache_hit_rate"] < 0.2
    assert fresh["workload"]["fresh_prompts"] and fresh["workload"]["seed"] != 777
    assert "warning" not in capsys.readouterr().err


def test_plan_reads_a_gguf_files_real_weight_bytes():
    from kvflow.models.gguf_file import gguf_weight_bytes
    from kvflow.models.registry import embedded_model_path
    from kvflow.plan.cli import stored_bytes_per_param

    path = embedded_model_path("smollm2-135m")
    nbytes, elements = gguf_weight_bytes(path)
    # The tensors are nearly the whole file (the rest: metadata, the vocabulary).
    assert 0.9 * os.path.getsize(path) < nbytes < os.path.getsize(path)
    per = stored_bytes_per_param(path)
    assert per == nbytes / elements and 0.55 < per < 0.8  # Q4_1 (+ a Q8_0 token table)
    assert stored_bytes_per_param("llama-3.1-8b") is None  # a preset: --dtype applies
    from kvflow.cli import main

    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "--model", path]) == 0
    text = out.getvalue()
    assert "GGUF as stored" in text and "weights                  0.09 GiB" in text
