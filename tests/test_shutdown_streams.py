"""SIGTERM with streams in flight: when the shutdown grace period runs out, each stream
ends with an error event and [DONE] (not cut mid-body), the server exits 0, and the log
holds no traceback."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
from server_utils import LIFECYCLE_ARGS, RemoteServer


def test_sigterm_ends_running_streams_cleanly():
    # The streams outlast the grace period (450 tokens, eager: tens of ms each): the
    # server must end them itself.
    srv = RemoteServer(["--shutdown-timeout", "3", *LIFECYCLE_ARGS])
    events: list[list[str]] = [[], []]
    first = [threading.Event(), threading.Event()]

    def stream(i: int) -> None:
        body = {"prompt": f"Count from {i} to a thousand:", "max_tokens": 450,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body,
                          timeout=300) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events[i].append(line[6:])
                    first[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        assert all(e.wait(240) for e in first)
        start = time.monotonic()
        code = srv.stop(signal.SIGTERM)
        for t in threads:
            t.join(60)
        log = srv.log()
    finally:
        srv.cleanup()
    assert code == 0, log
    assert time.monotonic() - start < 30
    for ev in events:
        assert ev[-1] == "[DONE]", ev[-3:]
        error = json.loads(ev[-2])["error"]
        assert "shutting down" in error["message"] and "--shutdown-timeout" in error["message"]
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log
