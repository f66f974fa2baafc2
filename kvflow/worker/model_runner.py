"""Turns a SchedulerOutput into tensors, runs the model, samples: one step of the worker."""

from __future__ import annotations

import time

import torch

from kvflow.config import GiB, EngineConfig
from kvflow.core.sched_output import LogprobsEntry, ModelRunnerOutput, SchedulerOutput
from kvflow.layers.attention import get_attention_backend
from kvflow.layers.custom_op import use_kernels
from kvflow.layers.sampler import Sampler, gather_logprobs
from kvflow.logger import init_logger
from kvflow.models.loader import load_model
from kvflow.worker import kv_cache
from kvflow.worker.block_table import DeviceBlockTable
from kvflow.worker.input_batch import InputBatch, RequestExtras
from kvflow.worker.sampling_meta import build_sampling_metadata
from kvflow.worker.step_inputs import PLACEHOLDER, StepInputs, build_step_inputs
from kvflow.worker.transfer import to_device, to_host_async

logger = init_logger(__name__)


class StepHandle:
    """A launched step: its GPU work is queued; ``result()`` waits for it alone (not for
    steps queued after it) and returns the sampled tokens as plain lists."""

    def __init__(self, runner: "ModelRunner", inputs: StepInputs | None, host: dict,
                 event: torch.cuda.Event | None) -> None:
        self.runner = runner
        self.inputs = inputs
        self.host = host  # pinned copies of the step's outputs
        self.event = event
        self._result: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._result is None:
            if self.event is not None:
                self.event.synchronize()
            self._result = self.runner.finish_step(self)
        return self._result


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device.device)
        self.block_size = config.cache.block_size
        self.use_kernels = self.device.type == "cuda" and _kernels_available()
        backend = get_attention_backend("triton" if self.use_kernels else "torch")
        start = time.perf_counter()
        self.model = load_model(config.model, self.device, backend)
        use_kernels(self.model, self.use_kernels)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        logger.info("loaded %s (%s, %s) on %s in %.1f s: %.2f GiB of weights, attention: %s",
                    config.model.name, config.model.load_format, config.model.dtype,
                    self.device, time.perf_counter() - start, self.weight_bytes / GiB,
                    backend.name)
        self.sampler = Sampler()
        self.vocab_size = config.model.arch.vocab_size
        self.eos_token_ids = list(config.model.arch.eos_token_ids)
        max_blocks = -(-config.model.max_model_len // self.block_size)
        self.batch = InputBatch(config.scheduler.max_num_seqs, config.model.max_model_len,
                                max_blocks)
        self.extras: dict[str, RequestExtras] = {}
        self.kv_caches: torch.Tensor | None = None  # [L, 2, NB, BS, KVH, D]
        self.host_cache: torch.Tensor | None = None  # [NH, L, 2, BS, KVH, D] swap space
        self.graphs = None  # CudaGraphRunner once captured
        self.device_block_table = None
        self.num_sms = 1
        # Tokens sampled by the last launched step, still on the device: req_id ->
        # (position in its sequence, index into last_sampled).
        self.last_sampled: torch.Tensor | None = None
        self.pending: dict[str, tuple[int, int]] = {}
        self.idle_meter = None  # a GpuIdleMeter while a benchmark measures GPU idle time
        if self.device.type == "cuda":
            self.batch.record_ops = True
            self.device_block_table = DeviceBlockTable(config.scheduler.max_num_seqs,
                                                       max_blocks, self.device)
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count

    # --- KV cache ---------------------------------------------------------------
    def determine_num_blocks(self) -> int:
        cfg = self.config
        if cfg.cache.num_blocks_override is not None:
            return cfg.cache.num_blocks_override
        if self.device.type == "cpu":
            return kv_cache.num_blocks_for_budget(
                cfg, kv_cache.cpu_kv_budget(cfg.cache.kv_cache_memory))
        if cfg.cache.kv_cache_memory is not None:
            return kv_cache.num_blocks_for_budget(cfg, cfg.cache.kv_cache_memory)
        from kvflow.worker.profiler import profile_kv_budget

        return kv_cache.num_blocks_for_budget(cfg, profile_kv_budget(self))

    def init_kv_cache(self, num_blocks: int) -> None:
        kv_cache.check_capacity(self.config, num_blocks)
        self.kv_caches = kv_cache.allocate_kv_cache(self.config, num_blocks, self.device)
        kv_cache.bind_kv_cache(self.model, self.kv_caches)
        kv_cache.log_kv_cache(self.config, num_blocks)
        host_blocks = kv_cache.num_host_blocks(self.config)
        if host_blocks:
            self.host_cache = kv_cache.allocate_host_cache(self.config, host_blocks, self.device)
            logger.info("swap space: %d blocks, %.2f GiB of %s host memory", host_blocks,
                        self.host_cache.numel() * self.host_cache.element_size() / GiB,
                        "pinned" if self.device.type == "cuda" else "plain")

    def warmup(self) -> None:
        """Compile kernels and capture CUDA graphs before serving (GPU only)."""
        if self.device.type != "cuda":
            return
        from kvflow.worker.cuda_graphs import warmup_and_capture

        warmup_and_capture(self)

    # --- one step ---------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(so).result()

    @torch.inference_mode()
    def execute_model_async(self, so: SchedulerOutput) -> StepHandle:
        """Queue a step's GPU work and return at once (CPU: runs it)."""
        self._update_states(so)
        # Order matters: a block swapped out may be reused by a swap-in or a copy.
        for dev_block, host_block in so.blocks_to_swap_out:
            self.host_cache[host_block].copy_(self.kv_caches[:, :, dev_block],
                                              non_blocking=True)
        for host_block, dev_block in so.blocks_to_swap_in:
            self.kv_caches[:, :, dev_block].copy_(
                self.host_cache[host_block].to(self.device, non_blocking=True))
        if so.blocks_to_copy:
            self._copy_blocks(so.blocks_to_copy)
        if so.total_num_scheduled_tokens == 0:
            return StepHandle(self, None, {}, None)
        if self.idle_meter is not None:
            self.idle_meter.step_start()
        inputs = build_step_inputs(self, so)
        if self.graphs is not None and self.graphs.can_run(inputs):
            hidden = self.graphs.run(inputs)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        return self._launch_sampling(inputs, hidden)

    def _update_states(self, so: SchedulerOutput) -> None:
        b = self.batch
        for rid in so.finished_req_ids:
            b.remove(rid)
            self.extras.pop(rid, None)
            self.pending.pop(rid, None)
        for rid in so.preempted_req_ids:
            b.remove(rid)  # extras (seeded generator) survive the preemption
            self.pending.pop(rid, None)
        for new in so.new_reqs:
            b.add(new)
            if new.req_id not in self.extras:
                extras = RequestExtras()
                if new.sampling_params.seed is not None:
                    extras.generator = torch.Generator(self.device).manual_seed(
                        new.sampling_params.seed)
                self.extras[new.req_id] = extras
        for cached in so.cached_reqs:
            b.append_blocks(cached.req_id, cached.new_block_ids)
            b.num_computed[b.index[cached.req_id]] = cached.num_computed_tokens

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst := block src in every layer, before the step runs."""
        idx = to_device(pairs, self.device, torch.int64)
        if self.use_kernels:
            from kvflow.kernels.copy_blocks import copy_blocks

            copy_blocks(self.kv_caches, idx)
        else:
            from kvflow.kernels.copy_blocks import copy_blocks_ref

            copy_blocks_ref(self.kv_caches, idx)

    def num_kv_splits(self, num_decodes: int, max_seq_len: int) -> int:
        if not self.use_kernels:
            return 1
        from kvflow.kernels.paged_attention import choose_num_kv_splits

        return choose_num_kv_splits(num_decodes, max_seq_len,
                                    self.config.model.arch.num_key_value_heads, self.num_sms)

    def pending_source(self, req_id: str, position: int) -> int:
        """Index into ``last_sampled`` of the in-flight token at ``position``."""
        pos, idx = self.pending[req_id]
        if pos != position:
            raise RuntimeError(f"request {req_id}: token {position} is unknown")
        return idx

    def _launch_sampling(self, inputs: StepInputs, hidden: torch.Tensor) -> StepHandle:
        b = self.batch
        host: dict = {}
        if len(inputs.sample_reqs):
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            sample_rows = inputs.rows[inputs.sample_reqs]
            sample_ids = [inputs.req_ids[i] for i in inputs.sample_reqs]
            meta = build_sampling_metadata(self, sample_rows, sample_ids)
            out = self.sampler(logits, meta)
            host["sampled"] = to_host_async(out.sampled)
            if out.logprobs is not None:
                host["lp"] = tuple(to_host_async(t) for t in (
                    out.logprob_token_ids, out.logprobs, out.sampled_ranks))
            # The sampled tokens join each sequence now, as placeholders: the next step
            # reads their values on the device, the host learns them in finish_step().
            self.last_sampled = out.sampled
            self.pending = {}
            slots = []  # (request index, req_id, position, logprobs asked)
            for j, rid in enumerate(sample_ids):
                row = int(sample_rows[j])
                pos = int(b.num_tokens[row])
                self.pending[rid] = (pos, j)
                slots.append((int(inputs.sample_reqs[j]), rid, pos, b.params[row].logprobs))
                b.append_token(row, PLACEHOLDER)
            host["slots"] = slots
        if inputs.plp_indices:
            host["plp"] = self._prompt_logprobs(inputs, hidden)
        event = None
        if self.device.type == "cuda":
            if self.idle_meter is not None:
                self.idle_meter.step_end()
            event = torch.cuda.Event()
            event.record()
        return StepHandle(self, inputs, host, event)

    def finish_step(self, handle: StepHandle) -> ModelRunnerOutput:
        """Turn a completed step's outputs into plain lists; fill in placeholders."""
        inputs = handle.inputs
        if inputs is None:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        b, host = self.batch, handle.host
        num_reqs = len(inputs.req_ids)
        sampled_lists: list[list[int]] = [[] for _ in range(num_reqs)]
        logprob_lists: list[list[LogprobsEntry] | None] = [None] * num_reqs
        if "sampled" in host:
            sampled = host["sampled"].tolist()
            lp = [t.tolist() for t in host["lp"]] if "lp" in host else None
            for j, (i, rid, pos, k) in enumerate(host["slots"]):
                token = sampled[j]
                sampled_lists[i] = [token]
                row = b.index.get(rid)
                if row is not None and b.token_ids[row, pos] == PLACEHOLDER:
                    b.token_ids[row, pos] = token
                if lp is not None and k is not None:
                    logprob_lists[i] = [(lp[0][j][: k + 1], lp[1][j][: k + 1], lp[2][j])]
        return ModelRunnerOutput(req_ids=inputs.req_ids, sampled_token_ids=sampled_lists,
                                 logprobs=logprob_lists,
                                 prompt_logprobs=self._prompt_logprobs_lists(host.get("plp")))

    def _prompt_logprobs(self, inputs: StepInputs, hidden: torch.Tensor):
        dev = self.device
        logits = self.model.compute_logits(hidden[to_device(inputs.plp_indices, dev,
                                                            torch.int64)])
        k_max = max(span[3] for span in inputs.plp_spans)
        ids, lps, ranks = gather_logprobs(logits.log_softmax(dim=-1),
                                          to_device(inputs.plp_targets, dev, torch.int64),
                                          k_max)
        return inputs.plp_spans, tuple(to_host_async(t) for t in (ids, lps, ranks))

    @staticmethod
    def _prompt_logprobs_lists(plp) -> dict[str, list[LogprobsEntry]]:
        if plp is None:
            return {}
        spans, tensors = plp
        ids, lps, ranks = (t.tolist() for t in tensors)
        return {rid: [(ids[j][: k + 1], lps[j][: k + 1], ranks[j]) for j in range(start, end)]
                for rid, start, end, k in spans}


def _kernels_available() -> bool:
    from kvflow import envs

    if envs.disable_triton():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
