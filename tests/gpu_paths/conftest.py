"""GPU code paths exercised on the CPU: Triton kernels under the interpreter."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
