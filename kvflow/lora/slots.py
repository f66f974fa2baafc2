"""Adapter slots on the device and the host cache behind them.

``--max-loras`` slots hold adapters' A/B in every wrapped layer (zero-padded to
``--max-lora-rank``); ``--max-cpu-loras`` adapters stay in host memory, read and checked
once. A step names the adapters its rows need (the scheduler keeps them within the slot
count); one not in a slot moves in, over the least recently used slot no row of this
step needs (a swap).
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch
from torch import nn

from kvflow.config import ModelArchConfig
from kvflow.errors import InvalidParameterError
from kvflow.layers.linear import LinearBase
from kvflow.lora.adapter import TARGETS, LoRAAdapter, load_adapter
from kvflow.lora.config import LoRAConfig
from kvflow.lora.layers import LoRALinearMethod, LoRAStepMap, LoRAWeights
from kvflow.lora.request import LoRARequest

# kvflow layer -> the HF projections of its slices, in output order
SLICES: dict[str, list[str]] = {}
for _hf, (_layer, _i) in TARGETS.items():
    SLICES.setdefault(_layer, []).append(_hf)


class _Target:
    """One wrapped linear: its slots and how checkpoint A/B map onto this rank."""

    def __init__(self, layer: LinearBase, index: int, kind: str, lora: LoRAConfig,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.layer, self.index, self.kind = layer, index, kind
        self.slices = SLICES[kind]
        tp = getattr(layer, "tp", None)
        self.row_parallel = hasattr(layer, "full_input_size")
        self.tp_rank = tp.rank_in_group if tp is not None else 0
        self.starts = getattr(layer, "shard_starts", [0] * len(self.slices))
        self.weights = LoRAWeights(layer.input_size, layer.output_sizes, lora.max_loras,
                                   lora.max_lora_rank, dtype, device)

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Slot := the adapter's matrices of this layer (zeros where it has none)."""
        w = self.weights
        a = w.a[slot].view(len(self.slices), w.rank, -1)  # [ns, R, in_local]
        a.zero_()
        for i, hf in enumerate(self.slices):
            b = w.b[i][slot]  # [out_i, R]
            b.zero_()
            mats = adapter.weights.get((self.index, hf))
            if mats is None:
                continue
            a_full, b_full = mats  # [r, in], [out, r]
            r = a_full.shape[0]
            if self.row_parallel:  # A keeps this rank's input columns
                n = self.layer.input_size
                a_full = a_full[:, self.tp_rank * n:(self.tp_rank + 1) * n]
            else:  # B keeps this rank's output rows of the slice
                b_full = b_full[self.starts[i]:self.starts[i] + w.out_sizes[i]]
            a[i, :r].copy_(a_full, non_blocking=True)
            b[:, :r].copy_(b_full, non_blocking=True)


class LoRASlots:
    """The device slots, the host cache, and the step map the wrapped layers read."""

    def __init__(self, model: nn.Module, arch: ModelArchConfig, lora: LoRAConfig,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.arch, self.lora, self.device = arch, lora, device
        self.step = LoRAStepMap()
        self.targets: list[_Target] = []
        for name, module in model.named_modules():
            parts = name.split(".")
            if not isinstance(module, LinearBase) or len(parts) < 5 \
                    or parts[:2] != ["model", "layers"]:
                continue
            kind = ".".join(parts[3:])
            if kind in SLICES:
                self.targets.append(_Target(module, int(parts[2]), kind, lora, dtype,
                                            device))
        self.slot_ids: list[int | None] = [None] * lora.max_loras  # lora_int_id per slot
        self.slot_rank = [0] * lora.max_loras
        self.slot_used: OrderedDict[int, None] = OrderedDict()  # slots, least recent first
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # int id -> adapter
        self.num_swaps = 0
        self.swap_s = 0.0  # seconds spent moving adapters into slots
        self.num_host_loads = 0
        self.installed = False

    @property
    def num_bytes(self) -> int:
        return sum(t.weights.num_bytes for t in self.targets)

    def install(self) -> None:
        """Wrap every target layer's method (after the C++ step and CUDA graphs were
        built on the plain ones: steps without adapter rows still take them)."""
        for t in self.targets:
            if not isinstance(t.layer.quant_method, LoRALinearMethod):
                t.layer.quant_method = LoRALinearMethod(t.layer.quant_method, t.weights,
                                                        self.step)
        self.installed = True

    # --- host cache ----------------------------------------------------------
    def host_adapter(self, req: LoRARequest) -> LoRAAdapter:
        got = self.host.get(req.lora_int_id)
        if got is not None and got.path == req.lora_path:
            self.host.move_to_end(req.lora_int_id)
            return got
        adapter = load_adapter(req.lora_path, req.lora_name, req.lora_int_id, self.arch,
                               self.lora)
        self.num_host_loads += 1
        self.host[req.lora_int_id] = adapter
        while len(self.host) > self.lora.cpu_capacity:
            self.host.popitem(last=False)
        return adapter

    # --- slots ---------------------------------------------------------------
    def activate(self, needed: list[LoRARequest]) -> dict[int, int]:
        """lora_int_id -> slot for each adapter a step needs, moving in those that are
        not in a slot yet."""
        ids = list(dict.fromkeys(r.lora_int_id for r in needed))
        if len(ids) > self.lora.max_loras:
            raise InvalidParameterError(f"a step needs {len(ids)} LoRA adapters but there "
                                        f"are {self.lora.max_loras} slots (--max-loras)",
                                        param="max_loras")
        where = {i: s for s, i in enumerate(self.slot_ids) if i is not None}
        out: dict[int, int] = {}
        for req in {r.lora_int_id: r for r in needed}.values():
            slot = where.get(req.lora_int_id)
            if slot is None:
                slot = self._free_slot(set(where[i] for i in ids if i in where))
                start = time.perf_counter()
                adapter = self.host_adapter(req)
                for t in self.targets:
                    t.write(slot, adapter)
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
                self.swap_s += time.perf_counter() - start
                self.slot_ids[slot], self.slot_rank[slot] = req.lora_int_id, adapter.rank
                where[req.lora_int_id] = slot
                self.num_swaps += 1
            self.slot_used.pop(slot, None)
            self.slot_used[slot] = None
            out[req.lora_int_id] = slot
        return out

    def _free_slot(self, keep: set[int]) -> int:
        for s, i in enumerate(self.slot_ids):
            if i is None:
                return s
        for s in self.slot_used:  # least recently used first
            if s not in keep:
                return s
        raise InvalidParameterError("every LoRA slot is in use by this step",
                                    param="max_loras")

    @property
    def num_slots_used(self) -> int:
        return sum(i is not None for i in self.slot_ids)
