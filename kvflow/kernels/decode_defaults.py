"""Per-GPU defaults of the batch-1 decode switches, from measurements only.

Each switch has an environment variable (``kvflow/envs.py``) that forces it; left unset
(or ``auto``) it takes the value measured best on this GPU: the ``decode_switches`` of
its data file in ``kvflow/kernels/tuning/`` (each file cites the result files it came
from). On a GPU without one, and off CUDA, every switch is off: the behaviour before the
switch existed, so an unmeasured GPU is never slower than before. The switches:

- ``rope_in_attn``: a decode-only step rotates q / k and writes the new K/V inside the
  decode attention launch instead of a ``rotary_kv`` launch (``paged_attention.py``);
- ``prefill_graphs``: a one-request step of at most 512 new tokens replays a CUDA graph
  captured at startup (``worker/cuda_graphs.py``, ``prefill_lens``) instead of running
  eagerly: a short prompt's time to first token.
"""

from __future__ import annotations

import torch

# The behaviour before the switches.
OFF: dict = {"rope_in_attn": False, "prefill_graphs": False}


def switch_on(mode: str, key: str, device: torch.device | None = None) -> bool:
    """An ``auto`` / ``on`` / ``off`` switch (its ``kvflow.envs`` reader's value): on or
    off as set, ``auto`` as this GPU's measurements say for ``key`` on ``device``."""
    return mode == "on" or (mode == "auto" and bool(measured(device)[key]))


def measured(device: torch.device | None = None) -> dict:
    """The switches' defaults on ``device`` (the current CUDA device when None; the
    pre-switch behaviour off CUDA)."""
    if device is not None and device.type != "cuda":
        return dict(OFF)
    if not torch.cuda.is_available():
        return dict(OFF)
    from kvflow.kernels import tuning

    return {**OFF, **{k: v for k, v in tuning.current(device).switches.items() if k in OFF}}
