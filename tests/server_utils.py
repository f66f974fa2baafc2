"""A real ``kvflow serve`` subprocess on 127.0.0.1 for the server tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

# Small and quick to start: the embedded model on CPU with a small KV cache.
SMALL_SERVER_ARGS = ["--max-model-len", "512", "--kv-cache-memory", "128MiB",
                     "--stats-log-interval", "2"]
STARTUP_TIMEOUT_S = 240
# For servers that test the process's life (shutdown, death, timeouts, limits) rather than
# how it decodes: no C++ CPU decode step, whose load and start-up self-check take about
# 8-15 s of each start on the 2-core CI machine (the shared ``server`` fixture and the
# tests of the step itself keep it on).
LIFECYCLE_ARGS = ["--enforce-eager"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_metrics(text: str) -> dict[str, float]:
    """kvflow:* samples of a /metrics page (label sets folded away, except the finish
    reason: ``kvflow:request_success_total{abort}``)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvflow:"):
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{")[0]
            if 'finished_reason="' in name_labels:
                name += "{" + name_labels.split('finished_reason="')[1].split('"')[0] + "}"
            values[name] = float(value)
    return values


class RemoteServer:
    """Starts ``python -m kvflow.cli serve`` and waits until /health says 200."""

    def __init__(self, extra_args: list[str], api_key: str | None = None) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile("w+", prefix="kvflow-serve-",
                                                suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "kvflow.cli", "serve", "--port", str(self.port),
               *SMALL_SERVER_ARGS, *extra_args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = {**os.environ, "KVFLOW_NO_PROGRESS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        with open(self._log.name) as f:
            return f.read()

    def core_pid(self) -> int:
        m = re.search(r"engine core pid (\d+)", self.log())
        assert m, self.log()
        return int(m.group(1))

    def metrics(self) -> dict[str, float]:
        """kvflow:* samples of /metrics (label sets folded away)."""
        return parse_metrics(httpx.get(f"{self.url}/metrics", headers=self.headers,
                                       timeout=10).text)

    def openai_client(self, async_client: bool = False):
        import openai

        cls = openai.AsyncOpenAI if async_client else openai.OpenAI
        return cls(base_url=f"{self.url}/v1", api_key=self.api_key or "none",
                   max_retries=0, timeout=120)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def cleanup(self) -> None:
        self.stop()
        os.unlink(self._log.name)

    def stop_clean(self) -> None:
        """Stop it (SIGTERM), require a clean exit (code 0, no traceback in its log: no
        request may raise inside the server), and remove its log."""
        log = self.log()
        code = self.stop()
        self.cleanup()
        assert "Traceback" not in log, log
        assert code == 0, log
