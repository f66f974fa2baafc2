"""Shared fixtures. GPU tests are marked ``gpu`` and skipped when no CUDA GPU is present."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("KVFLOW_NO_PROGRESS", "1")
# Most tests start short-lived engines: compiling each one's CPU decode step would cost
# more than the test. tests/test_cpu_compile.py turns it back on.
os.environ.setdefault("KVFLOW_CPU_COMPILE", "0")


def run_slow(config) -> bool:
    """Tests marked ``slow`` (long multi-process, soak and stress variants whose short
    forms run in CI) run with KVFLOW_SLOW_TESTS=1 (scripts/test_full.sh) or when asked
    for by name in ``-m`` (``pytest -m slow``); a plain ``pytest`` skips them."""
    return os.environ.get("KVFLOW_SLOW_TESTS") == "1" or "slow" in (config.option.markexpr
                                                                     or "")


# The files that take longest on CI's two cores (pytest --durations), run first: the two
# xdist workers (--dist loadfile: whole files) then end together instead of one waiting
# on a long file it drew last.
LONG_FILES = ("gpu_paths/test_gpu_plumbing.py", "test_smollm2_parity.py",
              "test_determinism.py", "test_server_fuzz.py", "test_cpu_step.py",
              "test_distributed.py", "test_cli.py", "kernels/test_sm90_build.py",
              "test_cpu_compile.py", "test_server_hardening.py", "test_dashboard.py",
              "test_bench_serve.py", "gpu_paths/test_lora_gpu_paths.py")


def pytest_collection_modifyitems(config, items):
    import torch

    here = os.path.dirname(os.path.abspath(__file__))
    rank = {os.path.join(here, name): i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(str(item.path), len(LONG_FILES)))  # stable

    if not run_slow(config):
        slow = pytest.mark.skip(reason="slow: KVFLOW_SLOW_TESTS=1 or scripts/test_full.sh "
                                       "runs it")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model (SmolLM2-135M-Instruct, float32 on CPU), shared."""
    from kvflow import LLM

    # Dense float32 (the GGUF dequantized), so greedy output can equal transformers'.
    return LLM("smollm2-135m", device="cpu", max_model_len=2048, kv_cache_memory="512MiB",
               quantization="none")


@pytest.fixture(scope="session")
def server():
    """One ``kvflow serve`` subprocess (smollm2-135m on CPU) shared by the server tests."""
    from server_utils import RemoteServer

    srv = RemoteServer(["--max-body-bytes", "65536"])
    yield srv
    srv.stop_clean()
