"""Turns a SchedulerOutput into tensors, runs the model, samples: one step of the worker."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvflow import envs
from kvflow.config import GiB, EngineConfig, torch_dtype
from kvflow.core.sched_output import ModelRunnerOutput, SchedulerOutput
from kvflow.cpu.memory import cpu_kv_budget
from kvflow.cpu.threads import step_thread_policy
from kvflow.distributed.parallel_state import ParallelState
from kvflow.layers.attention import (AttentionSpec, get_attention_backend,
                                    model_rotary)
from kvflow.layers.custom_op import use_kernels
from kvflow.layers.sampler import Sampler, SamplerOutput
from kvflow.logger import init_logger
from kvflow.models.loader import load_model
from kvflow.utils import cdiv
from kvflow.worker import kv_cache
from kvflow.worker.block_table import DeviceBlockTable
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.sampling_meta import apply_grammar_mask, prompt_logprobs_tensors
from kvflow.worker.step_builder import StepBuilder
from kvflow.worker.step_inputs import StepHostOutputs, StepInputs
from kvflow.worker.transfer import to_device, to_host_async

if TYPE_CHECKING:
    from kvflow.cpu.compiled import CpuCompiledStep
    from kvflow.cpu.step import CppDecodeStep
    from kvflow.worker.cuda_graphs import CudaGraphRunner

logger = init_logger(__name__)


class StepHandle:
    """A launched step: its device work is queued; ``result()`` waits for it alone (not
    for steps queued after it) and returns the sampled tokens as plain lists."""

    def __init__(self, builder: StepBuilder, inputs: StepInputs | None,
                 host: StepHostOutputs, event: torch.cuda.Event | None,
                 collect: Callable[[], None] | None = None, start: float = 0.0) -> None:
        self.builder = builder
        self.inputs = inputs
        self.host = host  # pinned copies of the step's outputs
        self.event = event
        self.start = start  # perf_counter() when the step began
        # Pipeline parallelism: waits for the results another rank sends and fills host.
        self.collect = collect
        self._result: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._result is None:
            if self.collect is not None:
                self.collect()
                self.collect = None
            if self.event is not None:
                self.event.synchronize()
            self._result = self.builder.finish(self.inputs, self.host,
                                               time.perf_counter() - self.start)
        return self._result


class ModelRunner:
    def __init__(self, config: EngineConfig, parallel: ParallelState | None = None) -> None:
        """``parallel``: this rank's process groups (None: a one-rank engine)."""
        self.config = config
        self.device = torch.device(config.device.device)
        self.parallel = parallel or ParallelState.single(self.device)
        self.block_size = config.cache.block_size
        self.use_kernels = self.device.type == "cuda" and _kernels_available()
        backend = get_attention_backend("triton" if self.use_kernels else "torch")
        start = time.perf_counter()
        self.model = load_model(config.model, self.device, backend, self.parallel.tp,
                                self.parallel.pp,
                                expert_parallel=config.parallel.enable_expert_parallel)
        # The forward pass: the whole model, or this rank's pipeline stage of it.
        self.forward_model = self.model
        if self.parallel.pp.world_size > 1:
            from kvflow.worker.pipeline_stage import PipelineStage

            self.forward_model = PipelineStage(self.model, self.parallel.pp)
        use_kernels(self.model, self.use_kernels)
        # --deterministic (GPU): batch-invariant linears, fixed split-KV attention
        self.deterministic = config.device.deterministic and self.use_kernels
        # What --deterministic leaves batch-dependent here (engine/determinism.py reads it)
        self.deterministic_gaps: list[str] = []
        if self.deterministic:
            self.deterministic_gaps = _use_batch_invariant(self.model, self.parallel)
        self.lora = None  # LoRAWorker with --enable-lora (kvflow/lora/worker.py)
        if config.lora is not None:
            from kvflow.lora.worker import LoRAWorker

            self.lora = LoRAWorker(config, self.model, self.device)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        logger.info("loaded %s (%s, %s) on %s in %.1f s: %.2f GiB of weights, attention: %s",
                    config.model.name, config.model.load_format, config.model.dtype,
                    self.device, time.perf_counter() - start, self.weight_bytes / GiB,
                    backend.name)
        self.sampler = Sampler()
        max_blocks = cdiv(config.model.max_model_len, self.block_size)
        self.num_sms = 1
        device_block_table = None
        if self.device.type == "cuda":
            device_block_table = DeviceBlockTable(config.scheduler.max_num_seqs, max_blocks,
                                                  self.device)
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.attn_spec = AttentionSpec(
            block_size=self.block_size, num_kv_heads=kv_cache.local_kv_heads(config),
            dtype=torch_dtype(config.model.dtype), device=self.device,
            rotary=model_rotary(self.model), num_sms=self.num_sms,
            deterministic=self.deterministic, max_model_len=config.model.max_model_len)
        self.spec = None  # SpecDecoder when speculative decoding is on
        if config.speculative is not None:
            from kvflow.spec_decode.verify import SpecDecoder

            self.spec = SpecDecoder(config, self.device, backend, self.use_kernels,
                                    self.model, torch_dtype(config.model.dtype))
        self.step_builder = StepBuilder(
            InputBatch(config.scheduler.max_num_seqs, config.model.max_model_len, max_blocks),
            self.block_size, self.device, backend.metadata_builder(self.attn_spec),
            config.model.arch.vocab_size, device_block_table, spec=self.spec,
            deterministic=self.deterministic)
        self.pipeline_results = None  # how a stage's step results reach the other ranks
        if self.parallel.pp.world_size > 1:
            from kvflow.worker.pipeline_stage import PipelineResults

            self.pipeline_results = PipelineResults(
                self.parallel, config.parallel.batches_in_flight > 1, self.step_builder,
                self.model, self.sampler)
        self.kv_caches: torch.Tensor | None = None  # [L, 2, NB, BS, KVH, D]
        self.host_cache: torch.Tensor | None = None  # [NH, L, 2, BS, KVH, D] swap space
        # An int8 cache's scales: [L, 2, NB, BS, KVH] and [NH, L, 2, BS, KVH] in swap.
        self.kv_scales: torch.Tensor | None = None
        self.host_scales: torch.Tensor | None = None
        # Once captured / built:
        self.graphs: CudaGraphRunner | CpuCompiledStep | CppDecodeStep | None = None
        self.idle_meter = None  # a GpuIdleMeter while a benchmark measures GPU idle time
        # CPU: small steps run on one thread or all of them, whichever measures faster
        # (cpu/threads.py; None elsewhere).
        self.thread_policy = step_thread_policy(config, self.parallel.world.world_size)
        # Constrained decoding: the rank that samples keeps the matchers; None elsewhere.
        self.structured = _structured_manager(config, self.parallel)
        self._last_handle: StepHandle | None = None  # resolves a constrained row's token

    # --- KV cache ---------------------------------------------------------------
    def initialize(self) -> int:
        """Size the KV cache (the fewest blocks any rank can hold), allocate it, warm up;
        returns the number of blocks. Every rank calls this in the same order: it contains
        collectives (none on one rank)."""
        num_blocks = self.parallel.world.min_int(self.determine_num_blocks())
        self.init_kv_cache(num_blocks)
        self.warmup()
        return num_blocks

    def determine_num_blocks(self) -> int:
        cfg = self.config
        if cfg.cache.num_blocks_override is not None:
            return cfg.cache.num_blocks_override
        if self.device.type == "cpu":
            return kv_cache.num_blocks_for_budget(cfg, cpu_kv_budget(cfg.cache.kv_cache_memory))
        if cfg.cache.kv_cache_memory is not None:
            return kv_cache.num_blocks_for_budget(cfg, cfg.cache.kv_cache_memory)
        from kvflow.worker.profiler import profile_kv_budget

        return kv_cache.num_blocks_for_budget(
            cfg, profile_kv_budget(cfg, self.model, self.device, self.execute_model))

    def init_kv_cache(self, num_blocks: int) -> None:
        kv_cache.check_capacity(self.config, num_blocks)
        self.kv_caches = kv_cache.allocate_kv_cache(self.config, num_blocks, self.device)
        self.kv_scales = kv_cache.allocate_kv_scales(self.config, num_blocks, self.device)
        kv_cache.bind_kv_cache(self.model, self.kv_caches, self.kv_scales,
                               kv_cache.kv_quant_kind(self.config))
        kv_cache.log_kv_cache(self.config, num_blocks)
        if self.spec is not None:
            self.spec.init_cache(num_blocks)  # a draft model's own cache, block for block
        host_blocks = kv_cache.num_host_blocks(self.config)
        if host_blocks:
            self.host_cache, self.host_scales = kv_cache.allocate_host_cache(
                self.config, host_blocks, self.device)
            logger.info("swap space: %d blocks, %.2f GiB of %s host memory", host_blocks,
                        host_blocks * kv_cache.block_bytes(self.config) / GiB,
                        "pinned" if self.device.type == "cuda" else "plain")

    def warmup(self) -> None:
        """Compile kernels and capture CUDA graphs before serving; on CPU, build the C++
        decode step (cpu/step.py) or the opt-in compiled one (cpu/compiled.py).
        LoRA wraps its layers after the C++ step (which calls the plain methods back and
        adds the deltas itself) and before the CUDA graphs (which then hold the LoRA
        kernels)."""
        self._warmup()
        if self.lora is not None:
            self.lora.slots.install()

    def _warmup(self) -> None:
        if self.device.type == "cpu":
            from kvflow.cpu.parts import StepParts
            from kvflow.cpu.step import cpu_decode_step

            self.graphs = cpu_decode_step(StepParts(
                self.model, self.step_builder.attn_builder, self.kv_caches, self.kv_scales,
                self.attn_spec, self.config, lora=self.lora))
            if self.graphs is not None:  # it marks the steps it takes
                self.step_builder.attn_builder = self.graphs.attn_builder
            if self.spec is not None:  # a draft model builds a C++ step of its own
                self.spec.warmup(self.graphs)
            return
        if self.device.type != "cuda" or self.parallel.pp.world_size > 1:
            return  # graphs do not hold the stage-to-stage sends (pipeline parallel)
        cfg = self.config
        if cfg.device.enforce_eager or not self.use_kernels:
            logger.info("CUDA graphs off (%s)", "--enforce-eager" if cfg.device.enforce_eager
                        else "no Triton kernels")
            return
        from kvflow.worker.cuda_graphs import (CudaGraphRunner, prefill_graphs_on,
                                               prefill_query_lens, verify_batch_sizes,
                                               verify_query_lens)

        verify_sizes, verify_lens = [], []
        if self.spec is not None:  # verification graphs: chains now, trees below
            verify_sizes = verify_batch_sizes(cfg.scheduler.max_num_seqs,
                                              cfg.speculative.disable_by_batch_size)
            if self.spec.tree is None:
                verify_lens = verify_query_lens(cfg.speculative.num_speculative_tokens)
        prefill_lens = []
        if prefill_graphs_on(self.device):  # a short prompt's TTFT on an idle engine
            prefill_lens = prefill_query_lens(cfg.scheduler.max_num_batched_tokens,
                                              cfg.model.max_model_len)
        if self.lora is not None:  # graphs hold the LoRA kernels: wrap before capture
            self.lora.slots.install()
        graphs = CudaGraphRunner(self.model, self.step_builder.attn_builder,
                                 cfg.scheduler.max_num_seqs, cfg.model.max_model_len,
                                 self.step_builder.device_block_table.table.shape[1],
                                 self.device, verify_sizes, verify_lens, prefill_lens,
                                 lora=self.lora)
        graphs.capture()
        if self.spec is not None and self.spec.tree is not None:
            graphs.capture_trees(self.spec.tree.num_nodes)
        self.graphs = graphs

    # --- one step ---------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(so).result()

    @torch.inference_mode()
    def execute_model_async(self, so: SchedulerOutput) -> StepHandle:
        """Queue a step's GPU work and return at once (CPU: runs it)."""
        if self.thread_policy is not None and so.total_num_scheduled_tokens:
            return self.thread_policy.run(so.total_num_scheduled_tokens,
                                          lambda: self._execute(so))
        return self._execute(so)

    def _execute(self, so: SchedulerOutput) -> StepHandle:
        start = time.perf_counter()
        self.step_builder.update(so)
        if self.lora is not None:
            self.lora.update(so)
        if self.structured is not None:
            self.structured.update(so)
        # Order matters: a block swapped out may be reused by a swap-in or a copy.
        for dev_block, host_block in so.blocks_to_swap_out:
            self.host_cache[host_block].copy_(self.kv_caches[:, :, dev_block],
                                              non_blocking=True)
            if self.kv_scales is not None:
                self.host_scales[host_block].copy_(self.kv_scales[:, :, dev_block],
                                                   non_blocking=True)
        for host_block, dev_block in so.blocks_to_swap_in:
            self.kv_caches[:, :, dev_block].copy_(
                self.host_cache[host_block].to(self.device, non_blocking=True))
            if self.kv_scales is not None:
                self.kv_scales[:, :, dev_block].copy_(
                    self.host_scales[host_block].to(self.device, non_blocking=True))
        if so.blocks_to_copy:
            self._copy_blocks(so.blocks_to_copy)
        if so.total_num_scheduled_tokens == 0:
            return StepHandle(self.step_builder, None, StepHostOutputs(), None)
        if self.idle_meter is not None:
            self.idle_meter.step_start()
        inputs = self.step_builder.build(so)
        # Steps with adapter rows run eager unless the CUDA graphs hold the LoRA kernels
        # or the C++ CPU step adds the deltas (graphs.run_eager: a CPU step gives one it
        # would take the eager plan first).
        eager = self.lora is not None and self.lora.prepare(
            inputs.req_ids, inputs.meta.query_start_loc_cpu)
        # The grammar mask: on the CPU filled first (the forward then has the cores), on
        # CUDA on the host once the forward is queued (it fills while the forward runs).
        mask = self._start_mask(inputs) if self.device.type == "cpu" else None
        if self.graphs is not None and not eager and self.graphs.can_run(inputs):
            hidden = self.graphs.run(inputs)
        elif self.graphs is not None:
            hidden = self.graphs.run_eager(inputs)
        else:
            hidden = self.forward_model(inputs.input_ids, inputs.positions, inputs.meta)
        if self.device.type != "cpu":
            mask = self._start_mask(inputs)
        handle = self._launch_sampling(inputs, hidden, start, mask)
        self._last_handle = handle
        return handle

    def _start_mask(self, inputs: StepInputs):
        """Start filling the grammar bitmask of the step's constrained rows (None: none).
        A constrained request whose last token is still in flight (overlapped steps)
        needs it on the host first: the previous step is resolved, only then.
        Pipeline parallelism: the sampling rank (a rank process) collects a step only
        after launching the next, so its batch holds the last step's tokens as
        placeholders; resolving that step there waits for nothing another rank sends
        (it sampled them itself: its handle has no ``collect``), so it joins no
        collective and the ranks stay in step."""
        if self.structured is None or not self.structured.reqs:
            return None
        # Drafts are the nodes of a candidate tree (Medusa) or a chain.
        tree = self.spec.tree if self.spec is not None else None
        try:
            plans = self.structured.plan(inputs, self.step_builder.batch, tree)
        except LookupError:
            self._last_handle.result()
            plans = self.structured.plan(inputs, self.step_builder.batch, tree)
        return None if plans is None else self.structured.start(plans)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst := block src in every layer, before the step runs."""
        idx = to_device(pairs, self.device, torch.int64)
        if self.use_kernels:
            from kvflow.kernels.copy_blocks import copy_blocks as copy
        else:
            from kvflow.kernels.copy_blocks import copy_blocks_ref as copy
        # One-byte caches copy as bytes (fp8 lacks CPU indexing ops); an int8 cache's
        # scales are blocks of their own tensor.
        caches = self.kv_caches
        copy(caches.view(torch.uint8) if caches.element_size() == 1 else caches, idx)
        if self.kv_scales is not None:
            copy(self.kv_scales, idx)

    def _launch_sampling(self, inputs: StepInputs, hidden: torch.Tensor,
                         start: float, mask=None) -> StepHandle:
        host = StepHostOutputs()
        collect = None
        if self.spec is not None and self.spec.wants_hidden and hidden is not None:
            host.sample_hidden = hidden[inputs.sample.logits_indices]  # [N, H] (Medusa)
        if self.pipeline_results is not None:  # speculative decoding is one-rank only
            collect = self.pipeline_results.launch(inputs, hidden, host, mask)
        elif inputs.sample.num_draft is not None and self.spec.tree is not None:
            self._verify_tree(inputs, hidden, host, mask)
        elif inputs.sample.num_draft is not None:
            sample, builder = inputs.sample, self.step_builder
            logits = apply_grammar_mask(self.model.compute_logits(
                hidden[sample.logits_indices]), mask)  # [N, V]
            tokens, logprobs = self.spec.verify(
                logits, builder.sampling_metadata(inputs), sample.num_draft,
                sample.draft_token_ids, builder.min_tokens_left(inputs),
                [inputs.req_ids[i] for i in sample.req_indices])
            host.sampled = to_host_async(tokens)
            if logprobs is not None:
                host.logprobs = tuple(to_host_async(t) for t in logprobs)
            host.slots = builder.record_verified(inputs)
        elif inputs.sample.num_reqs:
            logits = None if hidden is None else self.model.compute_logits(
                hidden[inputs.sample.logits_indices])  # only the last pipeline stage has them
            out = self._sample(apply_grammar_mask(logits, mask), inputs)  # mask: sampler
            host.sampled = to_host_async(out.sampled)
            if out.logprobs is not None:
                host.logprobs = tuple(to_host_async(t) for t in (
                    out.logprob_token_ids, out.logprobs, out.sampled_ranks))
            host.slots = self.step_builder.record_sampled(inputs, out.sampled)
        if inputs.pooling is not None and hidden is not None:
            host.pooled = self.step_builder.pooling.run(inputs.pooling, hidden,
                                                        self.model.compute_logits)
        if inputs.prompt_logprobs.indices and self.pipeline_results is None:
            plan = inputs.prompt_logprobs
            host.prompt_logprobs = (plan.spans, tuple(to_host_async(t) for t in (
                prompt_logprobs_tensors(plan, hidden, self.model.compute_logits))))
        event = None
        if self.device.type == "cuda":
            if self.idle_meter is not None:
                self.idle_meter.step_end()
            event = torch.cuda.Event()
            event.record()
        return StepHandle(self.step_builder, inputs, host, event, collect, start)

    def _verify_tree(self, inputs: StepInputs, hidden: torch.Tensor,
                     host: StepHostOutputs, mask=None) -> None:
        """Candidate trees: keep each request's longest accepted path, and move that
        path's K/V from its tree slots to the slots right after the root, where the
        scheduler's rollback (num_computed_tokens = root + path) expects it. ``mask``:
        the grammar's, each node's row masked with the state after its path (a node the
        grammar forbids gets probability 0 at its parent's row: never accepted)."""
        from kvflow.spec_decode.tree_verify import move_kv

        sample, builder = inputs.sample, self.step_builder
        logits = apply_grammar_mask(self.model.compute_logits(
            hidden[sample.logits_indices]), mask)  # [N, V]
        tokens, logprobs, out = self.spec.verify_tree(
            logits, builder.sampling_metadata(inputs), sample.num_draft,
            sample.draft_token_ids, builder.min_tokens_left(inputs))
        slots = inputs.meta.slot_mapping[sample.logits_indices]  # [N] slot of each row
        move_kv(self.kv_caches, self.kv_scales, slots[out.src_rows], slots[out.dst_rows])
        if host.sample_hidden is not None:  # the next drafts read the kept rows' states
            host.sample_hidden = host.sample_hidden[out.perm]
        host.sampled = to_host_async(tokens)
        if logprobs is not None:
            host.logprobs = tuple(to_host_async(t) for t in logprobs)
        host.slots = builder.record_verified(inputs)

    def _sample(self, logits: torch.Tensor | None, inputs: StepInputs) -> SamplerOutput:
        """One rank samples (the first TP rank of the last pipeline stage: rank 0 without
        pipeline parallelism) and broadcasts the tokens, so every rank's persistent batch
        holds the same ones (the others get them without logprobs)."""
        p = self.parallel
        sampler = p.world.world_size - p.tp.world_size  # first rank of the last stage
        if p.rank == sampler:
            out = self.sampler(logits, self.step_builder.sampling_metadata(inputs))
            p.world.broadcast(out.sampled, src=sampler)
            return out
        sampled = torch.empty(inputs.sample.num_reqs, dtype=torch.int64, device=self.device)
        return SamplerOutput(sampled=p.world.broadcast(sampled, src=sampler))


def _structured_manager(config: EngineConfig, parallel: ParallelState):
    """The sampling rank's StructuredOutputManager (constrained decoding), or None where
    this rank does not sample or the model has no tokenizer (the input processor then
    refuses constrained requests). The sampling rank is the first tensor-parallel rank of
    the last pipeline stage: rank 0 without pipeline parallelism."""
    samples = parallel.rank == parallel.world.world_size - parallel.tp.world_size
    if not samples or config.model.tokenizer is None:
        return None
    from kvflow.structured_output.manager import StructuredOutputManager

    # On a GPU the host idles while the forward runs: several threads fill a large step's
    # rows. On CPU the caller fills before the step (the forward has the cores), and no
    # pinned memory to copy from.
    cuda = config.device.is_cuda
    return StructuredOutputManager(config.model.tokenizer, config.model.arch.vocab_size,
                                   list(config.model.arch.eos_token_ids),
                                   fill_threads=min(8, (os.cpu_count() or 2) // 2)
                                   if cuda else 1, pin_memory=cuda, inline_fill=not cuda,
                                   isolate_failures=parallel.pp.world_size > 1)


def _kernels_available() -> bool:
    if envs.disable_triton():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _use_batch_invariant(model: torch.nn.Module, parallel: ParallelState) -> list[str]:
    """--deterministic on CUDA: switch the dense linears to the batch-invariant matmul;
    what stays outside the guarantee (docs/determinism.md), for the engine to refuse."""
    from kvflow.layers.linear import use_batch_invariant
    from kvflow.layers.moe.layer import FusedMoE

    switched, others = use_batch_invariant(model)
    logger.info("--deterministic: %d dense linear layers on the batch-invariant matmul, "
                "split-KV attention in fixed key ranges", switched)
    gaps = []
    if others:
        gaps.append(f"{len(others)} linear layers of other weight formats (e.g. {others[0]})")
    if any(isinstance(m, FusedMoE) for m in model.modules()):
        gaps.append("the fused MoE experts")
    if parallel.tp.world_size > 1:
        gaps.append(f"the all-reduce of {parallel.tp.world_size} tensor-parallel ranks")
    return gaps
