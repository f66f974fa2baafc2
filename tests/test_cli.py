"""The kvflow command end to end (subprocesses, the embedded default model)."""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys

ENV = {**os.environ, "KVFLOW_NO_PROGRESS": "1"}
# Eager decoding: these check the command, not the C++ CPU decode step (tested on its
# own and behind the shared server), whose start-up self-check would cost each run seconds.
SMALL = ["--max-model-len", "1024", "--kv-cache-memory", "256MiB", "--enforce-eager"]


def kvflow(*args: str, stdin: str | None = None, timeout: int = 300):
    return subprocess.run([sys.executable, "-m", "kvflow.cli", *args], input=stdin,
                          capture_output=True, text=True, env=ENV, timeout=timeout)


def test_generate_prints_answers_and_speed():
    # Greedy: this checks the command, not sampling (benchmarks/first_answers.py measures
    # the answers at the model's default sampling).
    p = kvflow("generate", *SMALL, "--prompt", "What is the capital of France?",
               "--max-tokens", "16", "--temperature", "0")
    assert p.returncode == 0, p.stderr
    assert ">>> What is the capital of France?" in p.stdout and "Paris" in p.stdout
    assert "output tokens/s" in p.stdout


def test_chat_in_process_streams_and_keeps_history(monkeypatch, capsys):
    """Each turn renders the whole conversation: the second prompt holds the first
    question and the reply that was streamed for it."""
    from kvflow import cli
    from kvflow.engine.tokenizer import Tokenizer

    rendered: list[list[dict]] = []
    render = Tokenizer.apply_chat_template

    def recording(self, messages, *args, **kwargs):
        rendered.append(copy.deepcopy(messages))
        return render(self, messages, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "apply_chat_template", recording)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Say hello.\n\nAnd again.\n/quit\n"))
    assert cli.main(["chat", *SMALL, "--max-tokens", "12", "--system", "Be brief."]) == 0
    streamed = capsys.readouterr().out
    assert len(rendered) == 2
    first_reply = rendered[1][2]["content"]
    assert first_reply.strip() and first_reply in streamed  # what was streamed is kept
    assert rendered[0] == [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "Say hello."}]
    assert rendered[1] == rendered[0] + [{"role": "assistant", "content": first_reply},
                                         {"role": "user", "content": "And again."}]


def test_errors_exit_2_with_a_message(tmp_path):
    p = kvflow("generate", str(tmp_path / "missing-model"))
    assert p.returncode == 2 and "error:" in p.stderr and "was not found" in p.stderr
    p = kvflow("generate", *SMALL, "--temperature", "-1")
    assert p.returncode == 2 and "temperature must be >= 0" in p.stderr


def test_bench_throughput_writes_result(tmp_path):
    out = tmp_path / "r.json"
    p = kvflow("bench", "throughput", "--model", "tiny-llama", "--load-format", "dummy",
               "--num-prompts", "8", "--input-len", "32", "--output-len", "8",
               "--save-result", str(out))
    assert p.returncode == 0, p.stderr
    result = json.loads(out.read_text())
    assert result["kvflow"]["output_tokens_per_s"] > 0
    assert result["workload"]["output_tokens"] == 64
    assert result["command"].startswith("kvflow bench throughput") and result["machine"]
