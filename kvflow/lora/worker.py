"""The model runner's side of LoRA: remembers each request's adapter, and before a step
runs puts the adapters it needs into slots and tells the wrapped layers which rows use
which slot: as groups of rows (the CPU's grouped matmuls) or, with the Triton kernels
(CUDA), as each row's slot in the kernels' device buffers (``kernel_inputs.py``), which
CUDA graphs captured with LoRA read as static inputs."""

from __future__ import annotations

from contextlib import contextmanager

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
        # Triton kernels for the delta (CUDA; tests force them under the interpreter)
        self.kernels = device.type == "cuda"
        self.max_tokens = config.scheduler.max_num_batched_tokens
        self._inputs = None  # LoRAKernelInputs, made on first use
        self.graph_tokens = 0  # rows of the largest CUDA graph holding the kernels; 0: none
        # The C++ CPU step adds the deltas itself (kvflow/cpu/step.py sets it once it
        # holds the slots): steps with adapter rows stay in it.
        self.in_cpu_step = False
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
        query_start_loc[i + 1]`` are request i's); returns whether the step must run
        eager: it has adapter rows and neither a CUDA graph nor the C++ CPU step holds
        the deltas (graphs captured without LoRA, the opt-in inductor step)."""
        step = self.slots.step
        lora = [self.requests.get(r) for r in req_ids]
        if not any(lora):
            step.groups, step.tiles = [], None
            step.token_slot = step.slot_rank = None
            if self.graph_tokens:
                self.inputs.clear()  # a replayed graph adds nothing
            return False
        where = self.slots.activate([r for r in lora if r is not None])
        if self.kernels:
            slot = np.array([-1 if r is None else where[r.lora_int_id] for r in lora],
                            dtype=np.int32)
            token_slot = np.repeat(slot, np.diff(np.asarray(query_start_loc)))
            from kvflow.kernels.lora import BLOCK_M_LARGE, BLOCK_M_SMALL

            # graphs hold small tiles: a step they may replay must use those too
            bm = BLOCK_M_SMALL if len(token_slot) <= max(self.graph_tokens, 256) \
                else BLOCK_M_LARGE
            step.groups = []
            step.tiles = self.inputs.fill(token_slot, self.slots.slot_rank, bm)
            return self.graph_tokens == 0
        # The C++ step's map: each row's slot and each slot's rank.
        slot = np.array([-1 if r is None else where[r.lora_int_id] for r in lora],
                        dtype=np.int32)
        step.token_slot = torch.from_numpy(np.repeat(slot, np.diff(query_start_loc)))
        step.slot_rank = torch.tensor(self.slots.slot_rank, dtype=torch.int32)
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
        step.groups, step.tiles = groups, None
        step.max_rank = max(self.slots.slot_rank[s] for s, _, _ in groups)
        return not self.in_cpu_step

    @property
    def inputs(self):
        if self._inputs is None:
            from kvflow.lora.kernel_inputs import LoRAKernelInputs

            self._inputs = LoRAKernelInputs(len(self.slots.slot_ids), self.max_tokens,
                                            self.device)
        return self._inputs

    # --- CUDA graphs (worker/cuda_graphs.py) ------------------------------------
    def reserve_graph_tokens(self, max_tokens: int) -> None:
        """Graphs of up to ``max_tokens`` rows will hold the kernels: room for them in
        the kernels' buffers before any graph is captured over them."""
        self.kernels = True
        self.inputs.reserve(max_tokens)
        self.graph_tokens = max(self.graph_tokens, max_tokens)

    @contextmanager
    def graph_step(self, num_tokens: int):
        """A graph's forward of ``num_tokens`` rows (its capture, or a test's eager
        stand-in): the kernels over the first tiles of the static buffers, whatever the
        step holds (slot -1 tiles return at once)."""
        from kvflow.kernels.lora import BLOCK_M_SMALL

        step = self.slots.step
        saved = step.groups, step.tiles
        step.groups, step.tiles = [], self.inputs.views(num_tokens, BLOCK_M_SMALL)
        try:
            yield
        finally:
            step.groups, step.tiles = saved

    def stats(self) -> dict[str, int | float]:
        s = self.slots
        return {"lora_slots_used": s.num_slots_used, "lora_slots": len(s.slot_ids),
                "lora_swaps": s.num_swaps, "lora_swap_s": s.swap_s,
                "lora_host_adapters": len(s.host)}
