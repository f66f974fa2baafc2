"""Kernel tests: on a machine without CUDA, Triton kernels run in its CPU interpreter.

TRITON_INTERPRET is read when ``@triton.jit`` decorates a kernel, so it must be set
before any ``kvflow.kernels`` module is imported; pytest loads this file before it
imports the test modules beside it.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def device() -> torch.device:
    """Where the small-shape tests run: the GPU when present, else the interpreter (CPU)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    """The interpreter's tensors are tiny; torch's intra-op thread pool only adds wake-up
    latency to each op there (milliseconds on a 2-core machine)."""
    if torch.cuda.is_available():
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
