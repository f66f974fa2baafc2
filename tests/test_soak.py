"""A short soak (scripts/soak.py): mixed requests with disconnects, client timeouts and
invalid ones against a live server with a small KV cache; afterwards nothing is running,
every KV block is back, no file descriptors leaked, memory flat, no 5xx."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def test_short_soak(tmp_path):
    import soak

    out = tmp_path / "soak.json"
    code = soak.main(["--requests", "120", "--concurrency", "12", "--max-tokens", "3",
                      "--max-words", "8", "--invalid-share", "0.1",
                      "--disconnect-share", "0.1", "--timeout-share", "0.05",
                      "--kv-cache-memory", "32MiB", "--save-result", str(out)])
    result = json.loads(out.read_text())
    assert code == 0, (result["checks"], result["failures"])
    counts = result["counts"]
    assert counts.get("complete", 0) > 50
    assert counts.get("refused_as_expected", 0) > 0 and counts.get("status_5xx", 0) == 0
    assert all(result["checks"].values()), result["checks"]
