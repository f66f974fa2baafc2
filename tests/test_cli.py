"""The kvflow command end to end (subprocesses, the embedded default model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ENV = {**os.environ, "KVFLOW_NO_PROGRESS": "1"}
SMALL = ["--max-model-len", "1024", "--kv-cache-memory", "256MiB"]


def kvflow(*args: str, stdin: str | None = None, timeout: int = 300):
    return subprocess.run([sys.executable, "-m", "kvflow.cli", *args], input=stdin,
                          capture_output=True, text=True, env=ENV, timeout=timeout)


def test_generate_prints_answers_and_speed():
    p = kvflow("generate", *SMALL, "--prompt", "What is the capital of France?",
               "--max-tokens", "16")
    assert p.returncode == 0, p.stderr
    assert ">>> What is the capital of France?" in p.stdout and "Paris" in p.stdout
    assert "output tokens/s" in p.stdout


def test_chat_in_process_streams_and_keeps_history():
    p = kvflow("chat", *SMALL, "--max-tokens", "12", stdin="Say hello.\nAnd again.\n\n")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("> ") >= 2 and len(p.stdout.strip()) > 10


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
