"""The compiled CPU decode step: the CPU's counterpart of CUDA graphs.

On CPU a decode step of a small model costs mostly the host work of issuing its few
thousand small torch ops (norms, rotary, residual adds, SiLU-mul, cache writes ...).
Here every decoder layer is compiled with ``torch.compile`` (inductor's C++/OpenMP
backend), which fuses those element-wise ops into a few C++ loops per layer and keeps
the matmuls and attention as library calls.

Why per layer and not the whole model: the layers share one code object and the same
shapes, so inductor compiles one layer graph (plus a variant for the first layer, which
has no residual yet, and one for batch size 1) and every layer reuses it. A whole-model
graph would be 30 layers of C++ to build at every cold start; one layer builds in
seconds and lands in inductor's on-disk FX graph cache, so later starts only re-trace.

Shapes are dynamic, so one graph serves every batch size and context length: decode
attention reads whole block-table rows and masks the positions past each sequence
(``TorchAttentionBackend.padded_decode_plan``), a plan made of tensors only. Steps with
prefill chunks or prompt logprobs run the eager path (``run_eager``), which keeps
compiled code out of the way with ``torch.compiler.set_stance("force_eager")``.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from kvflow import envs
from kvflow.cpu.kernels import build
from kvflow.cpu.parts import StepParts
from kvflow.layers.attention import AttentionMetadata, AttentionMetadataBuilder, AttentionSpec
from kvflow.layers.attention.torch_backend import PaddedDecodePlan
from kvflow.logger import init_logger
from kvflow.worker.step_inputs import PromptLogprobsPlan, StepInputs

logger = init_logger(__name__)


def find_cxx() -> str | None:
    """The C++ compiler inductor is to use: the CPU wing's (``build.find_compiler``), set
    as inductor's, or None when there is none."""
    cxx = build.find_compiler()
    if cxx is not None:
        from torch._inductor import config

        config.cpp.cxx = (cxx,)
    return cxx


def _decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList:
    """The model's stack of decoder layers (the ModuleList with one entry per layer)."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return module
    raise RuntimeError("the model has no list of decoder layers to compile")


class CompiledDecodeMetadataBuilder:
    """The torch backend's metadata builder, except that all-decode steps get the
    tensor-only PaddedDecodePlan the compiled layers were traced with."""

    def __init__(self, inner: AttentionMetadataBuilder, spec: AttentionSpec) -> None:
        self.inner = inner
        self.spec = spec

    def build(self, meta: AttentionMetadata, positions: torch.Tensor, *,
              split_context: int | None = None) -> AttentionMetadata:
        if meta.num_decodes != meta.num_reqs:
            return self.inner.build(meta, positions, split_context=split_context)
        # A one-block table is padded to two: width 1 would be one more specialized
        # graph to compile.
        meta.backend = PaddedDecodePlan.build(self.spec, meta, positions, min_width=2)
        return meta


class CpuCompiledStep:
    """Compiled decoder layers plus the decode plan that feeds them; the model runner
    calls ``run`` for the steps ``can_run`` accepts and ``run_eager`` for the others."""

    def __init__(self, model: nn.Module, attn_builder: AttentionMetadataBuilder,
                 spec: AttentionSpec, num_layers: int, max_num_seqs: int) -> None:
        self.model = model
        self.spec = spec
        self.layers = _decoder_layers(model, num_layers)
        self.max_num_seqs = max_num_seqs
        self._eager_builder = attn_builder
        # What the owner's step builder plans with while this step is installed.
        self.attn_builder: AttentionMetadataBuilder | CompiledDecodeMetadataBuilder = \
            attn_builder

    def compile(self) -> None:
        for layer in self.layers:
            layer.compile(dynamic=True)
        self.attn_builder = CompiledDecodeMetadataBuilder(self._eager_builder, self.spec)

    def uncompile(self) -> None:
        for layer in self.layers:
            layer._compiled_call_impl = None  # what nn.Module.compile() set
        self.attn_builder = self._eager_builder

    def can_run(self, inputs: StepInputs) -> bool:
        meta = inputs.meta
        return (isinstance(meta.backend, PaddedDecodePlan)
                and meta.num_reqs <= self.max_num_seqs and not inputs.prompt_logprobs.indices)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """An all-decode step through the compiled layers; hidden states [R, hidden]."""
        return self.model(inputs.input_ids, inputs.positions, inputs.meta)

    def run_eager(self, inputs: StepInputs) -> torch.Tensor:
        """Any other step, eagerly: compiled layers would trace the general plan. A step
        ``run`` would take (its owner runs it eager: adapter rows, LoRA) first gets the
        eager builder's plan in place of the padded decode plan."""
        if self.can_run(inputs):
            self._eager_builder.build(inputs.meta, inputs.positions)
        with torch.compiler.set_stance("force_eager"):
            return self.model(inputs.input_ids, inputs.positions, inputs.meta)

    @torch.inference_mode()
    def warmup(self, kv_caches: torch.Tensor) -> float:
        """Compile every graph a decode step can need (batch size 1, 2 and beyond; first
        and later layers) on throw-away inputs; returns the seconds it took."""
        start = time.perf_counter()
        saved = kv_caches[:, :, 0].clone()  # block 0 is scratch for the warm-up writes
        try:
            for bs in (1, 2, 3):
                if bs > self.max_num_seqs:
                    break
                self.run(self._dummy_inputs(bs, width=2))
        finally:
            kv_caches[:, :, 0].copy_(saved)
        return time.perf_counter() - start

    def _dummy_inputs(self, bs: int, width: int) -> StepInputs:
        block = self.spec.block_size
        seq_lens = torch.full((bs,), width * block, dtype=torch.int32)
        meta = AttentionMetadata(
            num_actual_tokens=bs, num_reqs=bs, num_decodes=bs, max_query_len=1,
            max_seq_len=width * block, slot_mapping=torch.arange(bs, dtype=torch.int64),
            query_start_loc=torch.arange(bs + 1, dtype=torch.int32), seq_lens=seq_lens,
            block_tables=torch.zeros(bs, width, dtype=torch.int32),
            query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=seq_lens.tolist())
        positions = (seq_lens - 1).long()
        self.attn_builder.build(meta, positions)
        return StepInputs(req_ids=[], rows=None, input_ids=torch.zeros(bs, dtype=torch.int64),
                          positions=positions, meta=meta, sample=None,
                          prompt_logprobs=PromptLogprobsPlan())


def compile_decode_step(parts: StepParts) -> CpuCompiledStep | None:
    """Compile the CPU decode step unless told not to or unable to (then: eager, logged);
    the caller installs its ``attn_builder``."""
    cfg = parts.config
    why_not = None
    if cfg.device.enforce_eager:
        why_not = "--enforce-eager"
    elif not envs.cpu_compile():
        why_not = "opt-in: set KVFLOW_CPU_COMPILE=1"
    elif find_cxx() is None:
        why_not = "no C++ compiler found (install g++ or set CXX)"
    if why_not is not None:
        logger.info("compiled CPU decode step off (%s): decoding eagerly", why_not)
        return None
    step = CpuCompiledStep(parts.model, parts.attn_builder, parts.attn_spec,
                           cfg.model.arch.num_hidden_layers, cfg.scheduler.max_num_seqs)
    step.compile()
    try:
        seconds = step.warmup(parts.kv_caches)
    except Exception as e:  # a broken toolchain must not stop the engine
        step.uncompile()
        torch._dynamo.reset()
        first_line = str(e).splitlines()[0] if str(e) else ""
        logger.warning("compiling the CPU decode step failed, decoding eagerly: %s: %s",
                       type(e).__name__, first_line)
        return None
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    logger.info("compiled CPU decode step: %d decoder layers, any batch size and context "
                "length, in %.1f s (inductor cache %s)", len(step.layers), seconds,
                cache_dir())
    return step
