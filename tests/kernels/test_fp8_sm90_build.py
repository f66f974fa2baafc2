"""The FP8 kernels' default configurations build for the H200 (sm_90) with the ptxas
Triton ships, without a GPU: no spills, shared memory within a Hopper block's 227 KiB.
The interpreter accepts kernels the compiler refuses (a plain global read inside a
kernel did), so this is the check before a GPU run. Runs in a child process, since this
directory's tests run the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import triton

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "benchmarks", "kernels", "fp8_sm90_build.py")
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="Triton's ptxas is not installed")
def test_fp8_kernels_build_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 4
    bad = [r for r in rows if not r["fits"]]
    assert not bad, bad
