"""The one dtype table: names, bytes per value, and the torch dtype of a name. Pure
Python (torch is imported only inside ``torch_dtype``), so config and the scheduler
read it without torch."""

from __future__ import annotations

# Bytes per value, and which names weights and activations may use (fp8 is a KV-cache
# format the planner sizes, not a model dtype).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
MODEL_DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
_TORCH_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                      "fp8": "float8_e4m3fn"}


def torch_dtype(name: str):
    """The torch dtype of a dtype name from DTYPE_BYTES (torch imported only here, so this
    module stays importable without it)."""
    import torch

    return getattr(torch, _TORCH_DTYPE_NAMES[name])
