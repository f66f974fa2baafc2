"""The README's "The API" examples, run as written against a live server (curl and the
openai client) and in-process (LLM): each must give an on-topic answer that ends on its
own (finish_reason "stop") on the first try, with no sampling settings of its own - the
model's recommended defaults (kvflow's registry entry for the embedded SmolLM2) do that."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")
README_URL = "http://127.0.0.1:8000"


def readme_blocks(lang: str) -> list[str]:
    """The fenced code blocks of one language in the README's "The API" section."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    section = text.split("## The API", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{lang}\n(.*?)```", section, flags=re.S)


def block_with(lang: str, needle: str) -> str:
    found = [b for b in readme_blocks(lang) if needle in b]
    assert len(found) == 1, f"expected one {lang} block with {needle!r} in README's The API"
    return found[0]


def on_topic(text: str, *words: str) -> bool:
    low = text.lower()
    return all(w in low for w in words)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_readme_curl_example(server):
    cmd = block_with("bash", "curl ").replace(README_URL, server.url)
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", body
    assert on_topic(choice["message"]["content"], "h2o"), body


def test_readme_openai_example(server):
    code = block_with("python", "from openai import OpenAI").replace(README_URL, server.url)
    scope: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md (openai example)", "exec"), scope)
    text = printed.getvalue()
    # The example's loop leaves its last chunk in `chunk`: the one that ends the stream.
    last = scope["chunk"]
    assert last.choices[0].finish_reason == "stop", text
    assert on_topic(text, "red", "blue", "yellow"), text


def test_readme_llm_example(tmp_path):
    # Its own process: the example builds an LLM with the default engine options.
    code = block_with("python", "from kvflow import LLM")
    code += "\nimport json\nprint('@@' + json.dumps({'finish': outs[0].outputs[0].finish_reason}))\n"
    script = tmp_path / "llm_example.py"
    script.write_text(code)
    env = {**os.environ, "KVFLOW_NO_PROGRESS": "1"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    text, _, meta = out.stdout.rpartition("@@")
    assert json.loads(meta)["finish"] == "stop", out.stdout
    assert on_topic(text, "blue") and ("scatter" in text.lower() or "light" in text.lower()), \
        out.stdout
