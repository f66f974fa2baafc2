"""When the engine-core process dies, /health turns 503, in-flight requests get an error,
the cause is logged and the server exits non-zero (so a supervisor restarts it)."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
from server_utils import LIFECYCLE_ARGS, RemoteServer


def test_engine_core_death_makes_server_exit_nonzero():
    srv = RemoteServer(LIFECYCLE_ARGS)
    try:
        core = srv.core_pid()
        results = {}

        def in_flight():
            r = httpx.post(f"{srv.url}/v1/completions",
                           json={"prompt": "Long story:", "max_tokens": 400,
                                 "ignore_eos": True}, timeout=60)
            results["status"], results["body"] = r.status_code, r.json()
        t = threading.Thread(target=in_flight)
        t.start()
        time.sleep(1.0)  # let it reach the engine
        os.kill(core, signal.SIGKILL)
        saw_503 = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and srv.proc.poll() is None:
            try:
                r = httpx.get(f"{srv.url}/health", timeout=2)
                if r.status_code == 503:
                    saw_503 = r.json()
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        assert saw_503 is not None, srv.log()
        assert saw_503["error"]["code"] == "engine_dead"
        assert "SIGKILL" in saw_503["error"]["message"]
        t.join(30)
        assert results["status"] == 503, results
        assert results["body"]["error"]["type"] == "service_unavailable"
        srv.proc.wait(30)
        assert srv.proc.returncode not in (0, None)
        log = srv.log()
        assert "engine core died" in log and "killed by SIGKILL" in log
    finally:
        srv.cleanup()


def _alive(pid: int) -> bool:
    """Running (an exited process whose new parent has not reaped it yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


def test_engine_core_exits_when_the_api_process_is_killed():
    srv = RemoteServer(LIFECYCLE_ARGS)
    try:
        core = srv.core_pid()
        with open(f"/proc/{core}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
        ipc_dir = os.path.dirname(args[args.index(b"--input") + 1].decode()[len("ipc://"):])
        assert os.path.isdir(ipc_dir) and os.stat(ipc_dir).st_mode & 0o777 == 0o700
        srv.proc.kill()
        srv.proc.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if not _alive(core):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the engine core outlived the API process")
        assert not os.path.exists(ipc_dir)
    finally:
        srv.cleanup()
