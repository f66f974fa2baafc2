"""``kvflow serve -tp 3``: the server answers like the one-rank engine, and a rank that
dies takes the engine down with the cause in /health, leaving no rank process behind."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
from server_utils import RemoteServer

from kvflow.sampling_params import SamplingParams


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


def test_server_with_tensor_parallel_ranks(smollm2):
    prompt = "The capital of France is"
    ref = smollm2.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                    ignore_eos=True), use_tqdm=False)
    # Dense weights, as the fixture's (GGUF blocks over 3 ranks: test_tp_quantized.py).
    srv = RemoteServer(["-tp", "3", "--distributed-timeout", "20", "--quantization", "none"])
    try:
        r = httpx.post(f"{srv.url}/v1/completions",
                       json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                             "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref[0].outputs[0].text

        m = re.search(r"started ranks \[1, 2\] \(pids \[(\d+), (\d+)\]\)", srv.log())
        assert m, srv.log()
        rank1, rank2 = int(m.group(1)), int(m.group(2))
        os.kill(rank1, signal.SIGKILL)
        # The next step notices; /health then says why the engine is gone.
        r = httpx.post(f"{srv.url}/v1/completions",
                       json={"prompt": prompt, "max_tokens": 8}, timeout=60)
        assert r.status_code == 503, r.text
        srv.proc.wait(30)
        assert srv.proc.returncode not in (0, None)
        log = srv.log()
        assert "rank 1" in log and "killed by SIGKILL" in log, log
        deadline = time.monotonic() + 10
        while _alive(rank2) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(rank2), "rank 2 outlived the engine"
    finally:
        srv.cleanup()
