"""The model runner's side of LoRA: remembers each request's adapter, and before a step
runs puts the adapters it needs into slots and tells the wrapped layers which rows use
which slot."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from kvflow.config import EngineConfig, torch_dtype
from kvflow.core.sched_output import SchedulerOutput
from kvflow.logger import init_logger
from kvflow.lora.request import LoRARequest
from kvflow.lora.slots import LoRASlots

logger = init_logger(__name__)


class LoRAWorker:
    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device) -> None:
        assert config.lora is not None
        self.slots = LoRASlots(model, config.model.arch, config.lora,
                               torch_dtype(config.model.dtype), device)
        self.device = device
        self.requests: dict[str, LoRARequest] = {}  # req_id -> adapter, adapter rows only
        logger.info("LoRA: %d slots of rank %d over %d layers: %.1f MiB",
                    config.lora.max_loras, config.lora.max_lora_rank,
                    len(self.slots.targets), self.slots.num_bytes / (1 << 20))

    def update(self, so: SchedulerOutput) -> None:
        """Track the adapters of new (or resumed) requests; forget finished ones."""
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for data in so.new_reqs:
            if data.lora_request is not None:
                self.requests[data.req_id] = data.lora_request
            else:
                self.requests.pop(data.req_id, None)

    def prepare(self, req_ids: list[str], query_start_loc: list[int]) -> bool:
        """Set the step map for a step of these requests (rows ``query_start_loc[i]:
        query_start_loc[i + 1]`` are request i's); returns whether any row uses an
        adapter (such steps run eager: the C++ step and CUDA graphs hold no deltas)."""
        step = self.slots.step
        lora = [self.requests.get(r) for r in req_ids]
        if not any(lora):
            step.groups = []
            return False
        where = self.slots.activate([r for r in lora if r is not None])
        runs: dict[int, list[tuple[int, int]]] = {}
        for i, r in enumerate(lora):
            if r is None:
                continue
            s, e = query_start_loc[i], query_start_loc[i + 1]
            slot = where[r.lora_int_id]
            spans = runs.setdefault(slot, [])
            if spans and spans[-1][1] == s:
                spans[-1] = (spans[-1][0], e)  # neighbours with one adapter: one run
            else:
                spans.append((s, e))
        groups = []
        for slot, spans in runs.items():
            if len(spans) == 1:
                rows = slice(*spans[0])
            else:
                rows = torch.from_numpy(np.concatenate(
                    [np.arange(s, e) for s, e in spans])).to(self.device)
            groups.append((slot, rows, self.slots.slot_rank[slot]))
        step.groups = groups
        step.max_rank = max(self.slots.slot_rank[s] for s, _, _ in groups)
        return True

    def stats(self) -> dict[str, int | float]:
        s = self.slots
        return {"lora_slots_used": s.num_slots_used, "lora_slots": len(s.slot_ids),
                "lora_swaps": s.num_swaps, "lora_swap_s": s.swap_s,
                "lora_host_adapters": len(s.host)}
