"""The live dashboard: its stats listener (fake clock), the KV block map, the routes, the
API key for browsers (Basic auth), and the page itself in a real headless Chromium while
load runs (skipped with the reason when Chromium or Playwright is missing)."""

from __future__ import annotations

import base64
import os
import shutil
import threading
import time

import httpx
import pytest

from kvflow.core.block_map import block_map
from kvflow.engine.messages import CoreStats
from kvflow.engine.stats import FinishedSequence, IterationStats
from kvflow.entrypoints.openai.dashboard import WINDOW_S, DashboardStats


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def core(**kw) -> CoreStats:
    base = dict(num_running=3, num_waiting=2, num_blocks=100, num_used_blocks=40,
                kv_cache_usage=0.4, num_preemptions=1, num_steps=9, num_cached_blocks=10,
                num_shared_blocks=5, block_map="0123")
    return CoreStats(**{**base, **kw})


def test_dashboard_stats_window():
    clock = Clock()
    d = DashboardStats("m", clock)
    d.record(core(), IterationStats(num_generation_tokens=50, prefix_cache_queries=100,
                                    prefix_cache_hits=25, ttfts_s=[0.1, 0.3]))
    clock.now += 1
    d.record(None, IterationStats(num_generation_tokens=30, finished=[
        FinishedSequence("stop", 1.0, 0.1, 0.02, 10, 40),
        FinishedSequence("length", 2.0, 0.3, 0.04, 10, 80)]))
    s = d.snapshot({"extra": 1})
    assert s["model"] == "m" and s["extra"] == 1
    assert s["queues"] == {"running": 3, "waiting": 2, "preemptions": 1}
    assert s["kv"]["free"] == 50 and s["kv"]["map"] == "0123"
    assert s["tokens_per_s"] == 8.0  # 80 tokens in the last 10 s
    assert s["prefix_cache"]["hit_rate_window"] == 0.25
    assert s["latency_ms"]["ttft"]["p50"] == pytest.approx(200.0)
    assert s["latency_ms"]["tpot"]["count"] == 2
    assert sum(s["latency_ms"]["tpot"]["histogram"]) == 2
    assert len(s["series"]) == WINDOW_S and s["series"][-1]["tokens"] == 30
    assert s["series"][-1]["running"] == 3  # carried forward from the last snapshot
    clock.now += WINDOW_S + 5  # everything ages out of the window
    s = d.snapshot()
    assert s["latency_ms"]["ttft"]["count"] == 0 and s["tokens_per_s"] == 0.0
    assert s["totals"]["generation_tokens"] == 80  # totals do not


def test_block_map_states_and_folding():
    class B:
        def __init__(self, ref, h=None):
            self.ref_cnt, self.block_hash = ref, h

    blocks = [B(0), B(1), B(0, 123), B(2), B(0), B(0)]
    m, counts = block_map(blocks)
    assert m == "012300"
    assert counts == {"free": 3, "used": 1, "cached": 1, "shared": 1}
    folded, _ = block_map(blocks, cells=3)  # pairs: the more notable state shows
    assert folded == "130"
    big, _ = block_map([B(0)] * 10000, cells=512)
    assert len(big) <= 512


def test_basic_auth_for_the_dashboard():
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from kvflow.entrypoints.openai.middleware import GuardMiddleware

    app = Starlette(routes=[Route("/dashboard", lambda r: PlainTextResponse("page")),
                            Route("/v1/models", lambda r: PlainTextResponse("models"))])
    client = TestClient(GuardMiddleware(app, api_key="sekret", max_body_bytes=1 << 20))
    r = client.get("/dashboard")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")
    assert client.get("/v1/models").headers["www-authenticate"] == "Bearer"
    good = base64.b64encode(b"anyone:sekret").decode()
    bad = base64.b64encode(b"anyone:wrong").decode()
    assert client.get("/dashboard", headers={"Authorization": f"Basic {good}"}).text == "page"
    assert client.get("/dashboard", headers={"Authorization": f"Basic {bad}"}).status_code == 401
    assert client.get("/dashboard", headers={"Authorization": "Basic !!"}).status_code == 401
    assert client.get("/dashboard", headers={"Authorization": "Bearer sekret"}).text == "page"


def test_dashboard_routes(server):
    page = httpx.get(f"{server.url}/dashboard", timeout=30)
    assert page.status_code == 200 and "kvflow dashboard" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # nothing fetched
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4},
                   timeout=120)
    assert r.status_code == 200
    d = httpx.get(f"{server.url}/dashboard/data", timeout=30).json()
    assert d["model"] == "smollm2-135m" and d["kv"]["num_blocks"] > 0
    assert d["totals"]["generation_tokens"] >= 4 and d["latency_ms"]["ttft"]["count"] >= 1
    assert len(d["kv"]["map"]) > 0 and set(d["kv"]["map"]) <= set("0123")


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def test_dashboard_in_a_browser(tmp_path):
    exe = _chromium()
    if exe is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium; scripts/setup.sh "
                    "does it on CI)")
    playwright = pytest.importorskip("playwright.sync_api",
                                     reason="playwright is not installed (pip install "
                                            "playwright)")
    from server_utils import LIFECYCLE_ARGS, RemoteServer

    srv = RemoteServer(LIFECYCLE_ARGS, api_key="dash-key")  # the page, not the decode path
    stop = threading.Event()

    def load() -> None:  # a stream of requests while the page watches
        with httpx.Client(timeout=120, headers=srv.headers) as c:
            while not stop.is_set():
                try:
                    c.post(f"{srv.url}/v1/completions",
                           json={"prompt": "Once upon a time", "max_tokens": 16,
                                 "ignore_eos": True})
                except httpx.HTTPError:
                    return  # the server is going away at the end of the test

    workers = [threading.Thread(target=load, daemon=True) for _ in range(3)]
    try:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=exe, headless=True,
                                        args=["--no-sandbox", "--disable-gpu"])
            ctx = browser.new_context(http_credentials={"username": "kvflow",
                                                        "password": "dash-key"},
                                      viewport={"width": 1280, "height": 860})
            page = ctx.new_page()
            page.goto(f"{srv.url}/dashboard")
            page.wait_for_function(
                "document.getElementById('model').textContent.includes('smollm2-135m')",
                timeout=30_000)
            before = page.text_content("#gen")
            for w in workers:
                w.start()
            # The numbers move while the load runs: tokens, throughput, finished sequences
            # (whose TPOTs fill the distribution).
            page.wait_for_function(
                f"document.getElementById('gen').textContent !== {before!r} && "
                "document.getElementById('tps').textContent !== '0.0' && "
                "Number(document.getElementById('finished').textContent"
                ".replace(/,/g, '')) >= 3", timeout=120_000)
            assert page.text_content("#tpotn") != "0"
            # The time series have axes with units (issue 29): values and minutes ago.
            q, t = page.locator("#queues"), page.locator("#tokens")
            assert q.get_attribute("data-yticks").endswith(" requests")
            assert t.get_attribute("data-yticks").startswith("0|")
            assert t.get_attribute("data-yticks").endswith(" tokens/s")
            assert q.get_attribute("data-xticks").split("|") == [
                "now", "1 min ago", "2 min ago", "3 min ago", "4 min ago"]
            assert page.locator("#ttft").get_attribute("data-yticks").endswith(" requests")
            assert page.text_content("#status").startswith("live")
            shot = os.environ.get("KVFLOW_DASHBOARD_SCREENSHOT") or str(tmp_path /
                                                                       "dashboard.png")
            page.screenshot(path=shot, full_page=True)
            assert os.path.getsize(shot) > 10_000
            browser.close()
    finally:
        stop.set()
        for w in workers:
            if w.is_alive():
                w.join(timeout=150)
        srv.stop()
        srv.cleanup()
