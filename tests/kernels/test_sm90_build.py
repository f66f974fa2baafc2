"""The Triton GEMMs' default launch configurations build for the H200 (sm_90) with the
ptxas Triton ships, without a GPU: no register spills, shared memory within the 227 KiB a
Hopper block may have. (The first int4 version spilled at 255 registers; the interpreter
also accepts kernels the compiler refuses, e.g. a plain global read inside a kernel.) So
this is the check before GPU time is spent. Each build script under benchmarks/kernels/
prints one JSON line per configuration; it runs in a child process, since this
directory's tests run Triton's interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import triton

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="Triton's ptxas is not installed")
@pytest.mark.parametrize("script,configs", [
    ("woq_sm90_build.py", 12),  # int8 / int4 weight-only GEMMs and GEMVs
    ("fp8_sm90_build.py", 5),  # FP8 W8A8 GEMM (its tensor-core promotion) and the quantize
    # batch-1 decode kernels: GEMVs, norm GEMVs, split-KV attention, norms, rotary; the
    # deterministic mode's fixed-split attention, its merge and the batch-invariant matmul
    ("decode_sm90_build.py", 20),
    # low-bit decode GEMVs (their inline PTX assembles), three with balanced rows
    ("woq_gemv_sm90_build.py", 13),
    # the fused MoE grouped GEMM per expert form: bf16, int8, int4 (one group a tile and
    # several), float8; gated and not
    ("moe_sm90_build.py", 10),
])
def test_default_configs_build_for_sm90_without_spills(script, configs):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kernels", script)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == configs
    bad = [r for r in rows if not r["fits"] or not r.get("promotion_as_configured", True)]
    assert not bad, bad
