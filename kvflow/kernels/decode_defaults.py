"""Per-GPU defaults of the batch-1 decode switches, from measurements only.

Each switch has an environment variable (``kvflow/envs.py``) that forces it; left unset
(or ``auto``) it takes the value measured best on this GPU (``MEASURED``, keyed by a
token of the device name), and on a GPU that is not listed, the behaviour before the
switch existed. So an unmeasured GPU is never slower than before. The switches:

- ``rope_in_attn``: a decode-only step rotates q / k and writes the new K/V inside the
  decode attention launch instead of a ``rotary_kv`` launch (``paged_attention.py``);
- ``prefill_graphs``: a one-request step of at most 512 new tokens replays a CUDA graph
  captured at startup (``worker/cuda_graphs.py``, ``prefill_lens``) instead of running
  eagerly: a short prompt's time to first token.
"""

from __future__ import annotations

import functools

import torch

# The behaviour before the switches.
OFF: dict = {"rope_in_attn": False, "prefill_graphs": False}

# device-name token -> the switches' measured best (each entry cites its result file).
# H200: the rotary inside decode attention, with the argmax kernel, +1.7-2.9 % in bf16, FP8
# and int4, each against the base runs beside it (results/decode-rope-*-h200.json;
# docs/decode-gemv.md).
# H100: the one-request prefill graphs take a 128-token prompt's time to first token on an
# idle 8B engine from 16.3 to 8.2 ms (GPU kernels 6.9 ms; 16..512 tokens 16-17 -> 7.3-14 ms,
# results/prefill-graphs-{off,on}-h100.json); the rotary inside decode attention, with the
# argmax kernel, +1.0-1.1 % GPU-A over the new GEMV table alone, alternated in one process
# (176.0 -> 177.9 / 177.7 tokens/s, results/decode-levers-fresh-h100.json).
MEASURED: dict[str, dict] = {"H200": {"rope_in_attn": True},
                             "H100": {"prefill_graphs": True, "rope_in_attn": True}}


@functools.lru_cache(maxsize=8)
def _for_index(index: int) -> dict:
    name = torch.cuda.get_device_name(index)
    for token, values in MEASURED.items():
        if token in name:
            return {**OFF, **values}
    return dict(OFF)


def switch_on(mode: str, key: str, device: torch.device | None = None) -> bool:
    """An ``auto`` / ``on`` / ``off`` switch (its ``kvflow.envs`` reader's value): on or
    off as set, ``auto`` as ``MEASURED`` says for ``key`` on ``device``."""
    return mode == "on" or (mode == "auto" and bool(measured(device)[key]))


def measured(device: torch.device | None = None) -> dict:
    """The switches' defaults on ``device`` (the current CUDA device when None; the
    pre-switch behaviour off CUDA)."""
    if device is not None and device.type != "cuda":
        return dict(OFF)
    if not torch.cuda.is_available():
        return dict(OFF)
    index = device.index if device is not None and device.index is not None else (
        torch.cuda.current_device())
    return _for_index(index)
