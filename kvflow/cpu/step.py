"""The C++ CPU decode step: all decoder layers of a step in one call (cpu/step.cpp).

On CPU a decode step of a small model is host work: eager PyTorch issues ~180 aten calls
per layer, each a microsecond or more of Python and dispatcher time. The C++ step runs
the whole stack of decoder layers (norms, QKV, rotary, paged cache write, paged
attention over the block tables, o_proj, residuals, MLP) in one call from Python; the
embedding before it and the lm head and sampler after it stay as they were.

It is built once with ``torch.utils.cpp_extension`` into torch's extension cache
(``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``) and loaded from
there at later starts. The weights are handed to the C++ object once, at warm-up; per
step only the step tensors cross. A linear layer kept quantized by its method (GGUF,
int8, int4 ...) is called back in Python with its activations, so every model of the
Llama family on one rank can use the step. Float32, int8 and fp8 KV caches are written
(quantized exactly as ``kv_quant.py`` does) and read by the paged attention kernel the
eager decodes run (``cpu/kernels/paged_attention.h``), which also applies a Medusa
verification step's tree masks, sliding windows (never reading a block before the
window's first) and soft-capped scores. ``cpu/stack.py`` reads the layer shape (Llama's,
or Gemma's four (1 + w) norms and GeGLU), q/k norms and each layer's rotary table, scale,
window and soft cap; MoE layers and tensor/pipeline parallelism keep the eager path.

Which steps: every step of a model it can run (decodes, prefill chunks of any length,
speculative verification, recomputation after preemption), so that one set of numerics
computes every row: a row's sums (the GEMVs per row, attention per token through the
paged kernel, norms per row) never depend on the rows beside it, and a request's tokens
and logprobs are the same alone, batched, chunked, cached or preempted
(docs/determinism.md). The eager path serves models the step cannot run and its
self-check.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from kvflow import envs
from kvflow.config import torch_dtype
from kvflow.cpu import verdict as cpu_verdict
from kvflow.cpu.kernels import build
from kvflow.cpu.kernels.build import find_compiler
from kvflow.cpu.parts import StepParts
from kvflow.cpu.stack import embedder, stack_args, step_linears, why_no_lora, why_unsupported
from kvflow.errors import KvflowError
from kvflow.layers.attention import AttentionMetadata, eager_reason
from kvflow.layers.attention.metadata import TreeAttention
from kvflow.layers.attention.kv_quant import keep_cache_values
from kvflow.layers.linear import UnquantizedLinearMethod
from kvflow.layers.quantization import layout_cache
from kvflow.logger import init_logger
from kvflow.spec_decode.tree import DraftTree
from kvflow.worker.step_inputs import StepInputs

logger = init_logger(__name__)

SOURCE = Path(__file__).with_name("step.cpp")
SOURCES = [SOURCE, Path(__file__).with_name("int4.cpp")]  # + the 4-bit GEMV
# Included by step.cpp: the paged attention kernel the eager decodes run too.
HEADERS = [Path(__file__).parent / "kernels" / "paged_attention.h"]
EXTENSION = "kvflow_cpu_step"
# -ffp-contract=off: no fused multiply-adds, so element-wise math rounds like eager ops.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]

_NO_TREE = torch.empty(0, dtype=torch.int64)  # forward's tree arguments for steps without one
_NO_LORA = torch.empty(0, dtype=torch.int32)  # forward's LoRA arguments: no adapter rows
# The int8-activation GEMV against float64 (gemv_error): rounding the activations to
# int8 per block of 32 costs ~0.5% of the output's scale on random rows; a wrong layout
# or kernel is off by order one.
GEMV_TOLERANCE = 5e-2
# A quantized KV cache: the K/V the step stores against those eager stores on its own,
# every layer, relative to the layer's largest (_check_one). Each layer's inputs differ
# by the rounding carried from the layers before (SmolLM2: 0.045 at most with float32
# activations); a cache write that is missing, misplaced or without rotary is off by
# order one.
WRITE_TOLERANCE = 3e-1


class CppStepPlan:
    """``meta.backend`` of a step the C++ step runs: nothing is planned in Python (the
    C++ side reads positions, slots, query starts, lengths and block tables itself)."""


CPP_PLAN = CppStepPlan()


def load_extension():
    """Build (first time) or load the C++ step; returns (module, seconds)."""
    return build.load_extension(EXTENSION, SOURCES, HEADERS, CFLAGS,
                                "the C++ CPU decode step")


def build_root() -> Path:
    """The C++ step's build folder (``build.extension_dir``)."""
    return build.extension_dir(EXTENSION, SOURCES + HEADERS, CFLAGS)


def _linear_args(lin: nn.Module) -> tuple[list[torch.Tensor], object, list[torch.Tensor],
                                           list[int]]:
    """([weight, bias], None, ...) of a dense layer; ([empty, bias], callable, ...) of one
    whose quantization method computes it (called back from C++ with the activations);
    the last two: the GEMV's [values, scale_bias] and [group, doubled, kind] when the
    method keeps that layout (``gemv``, GGUF), which C++ then uses for up to 16 rows."""
    empty = torch.empty(0)
    bias = lin.bias.detach() if lin.bias is not None else empty
    if type(lin.quant_method) is UnquantizedLinearMethod:
        return [lin.weight.detach(), bias], None, [empty, empty], [0, 0, 0]
    fn = functools.partial(lin.quant_method.apply, lin)
    gemv = getattr(lin.quant_method, "gemv", None)
    if gemv is None:
        return [empty, empty], fn, [empty, empty], [0, 0, 0]
    m = lin.quant_method
    return [empty, bias], fn, list(gemv), [m.group, int(m.doubled), m.gemv_kind]


def gemv_layouts(model: nn.Module) -> int:
    """Ask every quantization method that can describe its weights to the step's 4-bit
    GEMV (``make_gemv_layout``: GGUF) for that layout, unless KVFLOW_CPU_INT4_GEMV=0;
    the number of layers that have it."""
    if not envs.cpu_int4_gemv():
        return 0
    count = sum(m.quant_method.make_gemv_layout() for m in model.modules()
                if hasattr(getattr(m, "quant_method", None), "make_gemv_layout"))
    layout_cache.log_summary("4-bit GEMV layouts")
    return count


def int8_activations(model: nn.Module, module) -> int:
    """Switch every GGUF layer's GEMV copy (the tied lm_head's too) to int8 activations
    (the caller checks that the build has a SIMD kernel for them, AVX512-VNNI or AVX2,
    and that KVFLOW_CPU_INT8_ACT allows it) and move those copies into one arena of 2 MiB
    pages in the order a step reads them (``q8_arena``: the weights stream like one
    tensor); the number switched."""
    methods = [m.quant_method for m in model.modules()
               if hasattr(getattr(m, "quant_method", None), "to_int8_activations")]
    methods = [q for q in methods if q.to_int8_activations()]
    layout_cache.log_summary("int8-activation GEMV layouts")
    if not methods:
        return 0
    sizes = [-(-q.gemv[0].numel() // 64) * 64 for q in methods]  # 64-byte aligned pieces
    arena = module.q8_arena(sum(sizes))
    offset = 0
    for q, size in zip(methods, sizes):
        w = q.gemv[0]
        view = arena[offset:offset + w.numel()].view(w.shape)
        view.copy_(w)
        q.gemv = (view, q.gemv[1])
        offset += size
    return len(methods)


def use_step_gemv(model: nn.Module, int8: bool) -> int:
    """Run every GGUF linear of ``model`` (lm_head included) through the C++ step's GEMV
    for any number of rows (16 at a time), on int8 activations or float32 ones: the
    step's linear numerics on any forward, e.g. ``kvflow bench quality``'s prefill
    windows (the rounding is per row, so chunks change nothing). The layers switched."""
    module, _ = load_extension()
    gemv_layouts(model)
    if int8:
        if not module.q8_gemv_simd():
            logger.warning("this build has no AVX512-VNNI or AVX2 kernel: int8 activations "
                           "run the plain loops (slow)")
        int8_activations(model, module)
    count = 0

    def chunked(x, *args):
        return torch.cat([module.quant_gemv(x[i:i + 16].contiguous(), *args)
                          for i in range(0, x.shape[0], 16)])
    for name, m in model.named_modules():
        method = getattr(m, "quant_method", None)
        if getattr(method, "gemv", None) is None:
            continue
        method.run_gemv, method.run_gemv_any_rows = chunked, True
        method.head = name.endswith("lm_head")
        method.refine_gemv = module.q8_refine_top
        count += 1
    return count


class CppMetadataBuilder:
    """In place of the torch backend's builder (``inner``, kept for ``detach``): the
    steps the C++ step takes, all of them, get no Python plan at all (``CPP_PLAN``)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def build(self, meta: AttentionMetadata, positions: torch.Tensor, *,
              split_context: int | None = None) -> AttentionMetadata:
        # Candidate trees (Medusa) too: their masks go to C++ (forward's tree_bits and
        # tree_start), their depth positions come with the step's positions.
        meta.backend = CPP_PLAN
        return meta


class CppDecodeStep:
    """The C++ step behind the model runner's ``graphs`` hooks (``can_run``, ``run``,
    ``run_eager``), like the CUDA graphs on the GPU."""

    def __init__(self, parts: StepParts, module) -> None:
        model = parts.model
        inner = model.model
        cfg = model.config
        # int8 activations (VNNI or AVX2) before the layers hand their GEMV copies over.
        # Not with a quantized KV cache: through the self-check's 30 random layers the int8
        # rounding of the activations moves SmolLM2's output by 0.39 even with the eager
        # reference reading the K/V the step stored (0.51 over eager's own; the stored
        # K/V of late layers part by 1.45 of their scale), as much as an order-one error
        # the check must catch, so those engines keep float32 activations.
        gemv_layouts(model)  # the GGUF layers' copies for the step's own GEMV
        kv = parts.kv_caches.dtype
        self.num_int8_act = int8_activations(model, module) if (
            module.q8_gemv_simd() and envs.cpu_int8_act() and kv.is_floating_point
            and kv.itemsize > 1) else 0
        dense, fns, int4, int4_meta, caches = [], [], [], [], []
        self._int4_linears: list[nn.Module] = []
        for layer in inner.layers:
            attn = layer.self_attn
            for lin in step_linears(layer):
                wb, fn, q, meta = _linear_args(lin)
                dense += wb
                fns.append(fn)
                int4 += q
                if q[0].numel():  # C++ runs this one's 4-bit GEMV for up to 16 rows
                    self._int4_linears.append(lin)
                int4_meta += meta
            caches.append(attn.attn.kv_cache)
        first = inner.layers[0].self_attn
        eps = inner.norm.eps
        self.embed = embedder(model)
        stack = stack_args(model)
        # Windowed, soft-capped or own-rotary layers: the eager reference of a candidate
        # tree raises (windowed attention has no tree masks), so the self-check skips it.
        self.special = stack.special
        self.window = min([w for w in stack.windows if w], default=0)  # the narrowest
        self.model = model
        self.num_layers = len(caches)
        self.num_callbacks = sum(fn is not None for fn in fns)  # incl. the int4 GEMV's
        # The decoder layers' methods whose GEMV runs inside the step (GGUF, with a copy).
        self.gemv_methods = [lin.quant_method for lin in self._int4_linears]
        self.step = module.DecodeStep(
            stack.norms, dense, fns, int4, int4_meta, caches, stack.final_norm,
            stack.cos_sins, first.num_heads, first.num_kv_heads, first.head_dim, eps,
            stack.scales, stack.windows, stack.softcaps, stack.extra_norms, stack.gemma,
            stack.act)
        self.kv_scales = parts.kv_scales  # int8: [L, 2, NB, BS, KVH]
        self._kv_quants = [layer.self_attn.attn.kv_quant for layer in inner.layers]
        self.kv_kind = self._set_kv_quant(self._kv_quants)
        # The self-check's quantized-cache figures (see _check_one).
        self.write_error = 0.0  # the step's stored K/V against eager's own
        self.eager_error = 0.0  # the output against eager over eager's own K/V
        builder = parts.attn_builder
        self._eager_builder = builder.inner if isinstance(builder, CppMetadataBuilder) \
            else builder
        # What the owner's step builder plans with while this step is installed.
        self.attn_builder = CppMetadataBuilder(self._eager_builder)
        self.hidden_size = cfg.hidden_size
        self.num_int4 = self.step.num_int4
        self.module = module
        self.lora_map = None  # the LoRA step map (LoRAStepMap) once attach_lora ran
        self.num_lora = 0  # linears whose LoRA deltas the step adds

    def attach_lora(self, lora) -> None:
        """Add the LoRA deltas in C++ (``lora``: the LoRA worker; why_no_lora passed):
        every target's slots go to the step as they are (the tensors adapters are
        written into, read in place at each step), each step's row -> slot map is read
        from the worker's step map, and the worker stops sending adapter steps eager."""
        from kvflow.cpu.stack import LORA_LINEARS

        for t in lora.slots.targets:
            w = t.weights
            self.step.set_lora(t.index, LORA_LINEARS[t.kind], w.a, w.b_all, w.out_sizes)
        self.lora_map = lora.slots.step
        self.num_lora = self.step.num_lora
        lora.in_cpu_step = True

    def _set_kv_quant(self, quants: list) -> str | None:
        """Hand a quantized cache's scales to C++ (int8: each layer's scale tensor, fp8:
        its per-tensor k/v scales); the cache kind, None for the model dtype."""
        if all(q is None for q in quants):
            return None
        kind = quants[0].kind
        empty = torch.empty(0)
        self.step.set_kv_quant(kind, [q.scales if q.scales is not None else empty
                                      for q in quants],
                               [q.k_scale for q in quants], [q.v_scale for q in quants])
        return kind

    def detach(self) -> None:
        """Back to the eager path (a failed self-check, before the owner installs it)."""
        self.head_gemv(False)

    def head_gemv(self, on: bool) -> bool:
        """Hand the step's GEMV to the lm_head (``on``; False takes it back), for logits of
        up to 16 rows (any number on int8 activations): a tied GGUF head that keeps its
        layout gets ``quant_gemv``, a
        dense float32 one ``linear_f32`` (one pass over its weight for all rows, where
        F.linear read SmolLM2's 113 MB head at ~12 GB/s); whether there was one. Set
        after the self-check, whose eager reference must not use it."""
        head = getattr(self.model, "lm_head", None)
        method = getattr(head, "quant_method", None)
        if type(method) is UnquantizedLinearMethod:
            if head.weight.dtype != torch.float32 or head.weight.device.type != "cpu":
                return False
            head.cpu_gemv = self._dense_head if on else None
            return True
        if getattr(method, "gemv", None) is None:
            return False
        method.run_gemv = self.module.quant_gemv if on else None
        method.head = on
        method.refine_gemv = self.module.q8_refine_top if on else None
        return True

    def _dense_head(self, x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
        return self.module.linear_f32(x, weight, _NO_TREE if bias is None else bias)

    def can_run(self, inputs: StepInputs) -> bool:
        return inputs.meta.backend is CPP_PLAN

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """The step's decoder layers in C++; final hidden states [T, hidden]."""
        meta = inputs.meta
        tree = meta.tree
        bits, start = (tree.bits, tree.start) if tree is not None and any(tree.sizes_cpu) \
            else (_NO_TREE, _NO_TREE)
        prompt = _NO_TREE if inputs.prompt_rows is None else inputs.prompt_rows
        lora = self.lora_map
        slots, ranks = (_NO_LORA, _NO_LORA) if lora is None or lora.token_slot is None \
            else (lora.token_slot, lora.slot_rank)
        return self.step.forward(self.embed(inputs.input_ids), inputs.positions,
                                 meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                                 meta.block_tables, bits, start, prompt, slots, ranks)

    def run_eager(self, inputs: StepInputs) -> torch.Tensor:
        """Any step eagerly; one this step would take (its owner runs it eager: adapter
        rows whose LoRA deltas the step does not add, ``why_no_lora``) first gets the
        Python plan its builder left to C++."""
        if inputs.meta.backend is CPP_PLAN:
            self._eager_builder.build(inputs.meta, inputs.positions)
        return self.model(inputs.input_ids, inputs.positions, inputs.meta)

    @torch.inference_mode()
    def self_check(self, kv_caches: torch.Tensor, block_size: int) -> float:
        """Run throw-away steps both ways (two decodes and a 3-token chunk, then the two
        decodes alone: both take the GEMV of quantized layers, up to 16 rows) and return
        the largest difference relative to the eager output's scale; the blocks they
        write (0 to 3) are restored. A cache of fewer blocks skips it (0.0)."""
        if kv_caches.shape[2] < 4:
            return 0.0
        blocks = self._check_blocks(kv_caches)
        saved = [b.clone() for b in blocks]
        gen = torch.Generator().manual_seed(0)
        # The eager reference runs the layers' GEMV too (their numerics are checked on
        # their own, gemv_error): what is left to differ is the rest of the step. (The
        # GEMV's float32 or int8 inputs and the eager int4 GEMM's bf16 ones part by
        # 0.11 through a float cache and 0.26-0.39 through a quantized one on SmolLM2: a
        # K/V value one rounding step apart is one quantization step apart.)
        for m in self.gemv_methods:
            m.run_gemv = self.module.quant_gemv
        try:
            # Fill the context both ways read with something that is not zero.
            for b in blocks:
                if b.dtype == torch.int8:  # stored int8 values; their scales are float32
                    b.random_(-127, 128, generator=gen)
                elif b is not blocks[0]:  # int8 scales: values up to ~2.5 as dequantized
                    b.uniform_(0.005, 0.02, generator=gen)
                elif b.dtype.is_floating_point and b.dtype.itemsize > 1:  # float caches
                    b.normal_(generator=gen)
                else:  # fp8 (normal_ lacks float8): rounded to E4M3 by copy_
                    b.copy_(torch.randn(b.shape, generator=gen))
            mixed = self._check_one(kv_caches, block_size, [block_size + 3, 5, 7], [1, 1, 3],
                                    [[0, 1], [2, 0], [3, 0]], gen)
            decodes = self._check_one(kv_caches, block_size, [block_size + 3, 5], [1, 1],
                                      [[0, 1], [2, 0]], gen)
            # A Medusa verification step: request 1's 4 tokens are a tree's root and
            # three nodes ((0,), (1,), (0, 0)), masked and at depth positions.
            tree = 0.0 if block_size < 4 or self.special else self._check_one(
                kv_caches, block_size, [block_size + 3, block_size + 4], [1, 4],
                [[0, 1], [2, 3]], gen, tree=((0,), (1,), (0, 0)))
            return max(mixed, decodes, tree, self._check_window(kv_caches, block_size, gen))
        finally:
            for b, v in zip(blocks, saved):
                b.copy_(v)
            for m in self.gemv_methods:
                m.run_gemv = None

    def _check_window(self, kv_caches: torch.Tensor, block_size: int,
                      gen: torch.Generator) -> float:
        """A 3-token chunk past the narrowest window, where the 4 blocks hold one (after
        a decode in a block of its own where 3 do: requests that write slots the other
        reads would be read before or after the write depending on the backend). 0.0
        without such a window."""
        bs = block_size
        if 0 < self.window < 3 * bs - 3:
            return self._check_one(kv_caches, bs, [3, 3 * bs - 1], [1, 3],
                                   [[3, 0, 0], [0, 1, 2]], gen)  # decodes first
        if 0 < self.window < 4 * bs - 3:
            return self._check_one(kv_caches, bs, [4 * bs - 1], [3], [[0, 1, 2, 3]], gen)
        return 0.0

    def _check_blocks(self, kv_caches: torch.Tensor) -> list[torch.Tensor]:
        """What the self-check writes: blocks 0 to 3 of every layer's cache, and of an
        int8 cache's scales."""
        blocks = [kv_caches[:, :, :4]]
        if self.kv_kind == "int8":
            blocks.append(self.kv_scales[:, :, :4])
        return blocks

    @torch.inference_mode()
    def gemv_error(self) -> float:
        """The GEMV on its own, on random rows (1 and 5), relative to the output's scale:
        the first layer's int8-activation linears and the lm_head against the float64
        product with their dequantized weights (~1e-2: the int8 rounding), float32
        ones against the int4 GEMM (~1e-2: its bf16 inputs). 0.0 without such layers."""
        from kvflow.layers.quantization.packed import q8_dequantize

        gen = torch.Generator().manual_seed(1)
        head = getattr(getattr(self.model, "lm_head", None), "quant_method", None)
        worst = 0.0
        for lin in self._int4_linears[:4]:
            m = lin.quant_method
            for rows in (1, 5):
                x = torch.randn(rows, lin.input_size, generator=gen)
                got = self.module.quant_gemv(x, *m.gemv, m.group, m.doubled, m.gemv_kind)
                if m.gemv_kind:
                    want = x.double() @ q8_dequantize(m.gemv[0], m.gemv_kind).double().t()
                else:
                    want = m.apply(lin, x).double() - (lin.bias.double() if lin.bias
                                                       is not None else 0.0)
                worst = max(worst, float((got - want).abs().max() / want.abs().max()))
        if getattr(head, "gemv_kind", 0):
            x = torch.randn(2, head.gemv[0].shape[1] // (40 if head.gemv_kind == 4 else 72)
                            * 64, generator=gen)
            got = self.module.quant_gemv(x, *head.gemv, head.group, head.doubled,
                                         head.gemv_kind)
            want = x.double() @ q8_dequantize(head.gemv[0], head.gemv_kind).double().t()
            worst = max(worst, float((got - want).abs().max() / want.abs().max()))
        return worst

    def _check_one(self, kv_caches: torch.Tensor, block_size: int, lens: list[int],
                   qlens: list[int], table: list[list[int]], gen: torch.Generator,
                   tree: tuple | None = None) -> float:
        """One step both ways: ``lens`` contexts after it, ``qlens`` new tokens each (with
        ``tree``, a candidate tree's choices: the last request's tokens are its root and
        nodes); the output's error relative to its scale. A quantized cache: the eager reference
        runs over the K/V values the step stored (``keep_cache_values``), so that one
        float32 rounding difference upstream of the cache write, which moves a value a
        whole quantization step, is not carried through the layers as a difference of
        the step; what the step stores is compared with what eager stores on its own
        (``self.write_error``: every layer's new K/V, relative to their scale)."""
        tables = torch.tensor(table, dtype=torch.int32)
        positions, slots = [], []
        draft_tree = None if tree is None else DraftTree.from_choices(tree)
        for r, (n, q) in enumerate(zip(lens, qlens)):
            depth = [0] * q
            if draft_tree is not None and r == len(lens) - 1:
                depth = [0] + [int(x) for x in draft_tree.depth]
            for p, dp in zip(range(n - q, n), depth):
                positions.append(n - q + dp)  # a tree token's rotary position: its depth
                slots.append(int(tables[r, p // block_size]) * block_size + p % block_size)
        qsl = [0]
        for q in qlens:
            qsl.append(qsl[-1] + q)
        ids = torch.randint(0, self.embed_vocab(), (len(positions),), generator=gen)
        meta = AttentionMetadata(
            num_actual_tokens=len(positions), num_reqs=len(lens),
            num_decodes=sum(q == 1 for q in qlens), max_query_len=max(qlens),
            max_seq_len=max(lens), slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
            query_start_loc_cpu=qsl, seq_lens_cpu=lens,
            tree=None if draft_tree is None else TreeAttention.build(
                [None] * (len(lens) - 1) + [draft_tree.visible], qsl, lens,
                torch.device("cpu")))
        pos = torch.tensor(positions)
        self._eager_builder.build(meta, pos)
        blocks = self._check_blocks(kv_caches)
        before = [b.clone() for b in blocks]
        want = self.model(ids, pos, meta).float()
        eager_kv = self._written_kv(blocks, meta.slot_mapping)
        for b, v in zip(blocks, before):
            b.copy_(v)
        bits, start = (_NO_TREE, _NO_TREE) if meta.tree is None else (meta.tree.bits,
                                                                      meta.tree.start)
        got = self.step.forward(self.embed(ids), pos, meta.slot_mapping,
                                meta.query_start_loc, meta.seq_lens, tables, bits,
                                start, _NO_TREE, _NO_LORA, _NO_LORA).float()
        if self.kv_kind is not None:
            step_kv = self._written_kv(blocks, meta.slot_mapping)
            scale = eager_kv.abs().amax(dim=(1, 2, 3, 4)).clamp_min(1e-6)  # per layer
            self.write_error = max(self.write_error, float(
                ((step_kv - eager_kv).abs().amax(dim=(1, 2, 3, 4)) / scale).max()))
            self.eager_error = max(self.eager_error, float(
                (got - want).abs().max() / want.abs().max().clamp_min(1e-6)))
            with keep_cache_values():  # the step's stored K/V, read by both
                want = self.model(ids, pos, meta).float()
        for b, v in zip(blocks, before):
            b.copy_(v)
        return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))

    def _written_kv(self, blocks: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
        """The K/V the cache holds at flat ``slots`` of blocks 0 to 3, every layer,
        dequantized: [L, 2, T, KVH, D] float32 (a float cache: as stored)."""
        cache = blocks[0]
        n, _, nb, bs, kvh, d = cache.shape
        raw = cache.reshape(n, 2, nb * bs, kvh, d)[:, :, slots]
        if self.kv_kind == "int8":
            scales = blocks[1].reshape(n, 2, nb * bs, kvh)[:, :, slots]
            return raw.float() * scales.unsqueeze(-1)
        out = raw.float()
        if self.kv_kind == "fp8":
            kv = torch.tensor([[q.k_scale, q.v_scale] for q in self._kv_quants])
            out *= kv.view(n, 2, 1, 1, 1)
        return out

    def embed_vocab(self) -> int:
        return self.model.config.vocab_size


def _tolerance(step: CppDecodeStep, kv_caches: torch.Tensor) -> float:
    """The self-check's bound on the step's output against eager's, relative to its
    scale. Rounding differences stay far below it; a wrong step (a layer skipped, rotary
    misplaced) is off by order one."""
    # Quantized linears called back (the int4 GEMM rounds its inputs to bf16) amplify
    # the float32 rounding differences like a 16-bit model; those that run the step's
    # GEMV run the same GEMV in the eager reference.
    exact = kv_caches.dtype == torch.float32 and step.num_callbacks == step.num_int4
    # int8 activations: a float32 rounding difference upstream can move a value across
    # a rounding boundary of the int8 grid (a step of 1/127 of its block's largest
    # value), and the self-check's random tokens and cache carry that through 30 layers
    # of SmolLM2 to 0.07 (float32 activations: 2e-5).
    # (A quantized cache: the eager reference reads the step's stored K/V, see
    # _check_one; SmolLM2, float32 activations: 5.5e-4 against 9.3e-3 over eager's own.)
    return 1.5e-1 if step.num_int8_act else 1e-2 if exact else 1e-1


def _self_check(step: CppDecodeStep, kv_caches: torch.Tensor, block_size: int
                ) -> tuple[float, float]:
    """(the step against eager, its GEMV against float64), on one thread: the check's
    small steps gain nothing from a second one, and on a busy machine each op split
    over two threads waits for the descheduled one (cpu/threads.py), which made the
    check 8-15 s of an engine start there."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return step.self_check(kv_caches, block_size), step.gemv_error()
    finally:
        torch.set_num_threads(threads)


def _verdict_key(parts: StepParts, step: CppDecodeStep, label: str) -> str | None:
    """The self-check record's key (cpu/verdict.py), None for a model without files (or
    whose files cannot be read again: then the check runs)."""
    cfg = parts.config
    models = [cfg.model] + ([cfg.draft_model] if cfg.draft_model is not None else [])
    try:
        ids = [cpu_verdict.model_identity(m.path, m.load_format) for m in models]
    except (OSError, KvflowError):
        return None
    if any(i is None for i in ids):
        return None
    kv = parts.kv_caches
    facts = [label, repr(cfg.model), repr(cfg.draft_model), repr(cfg.cache), repr(cfg.device),
             str(kv.dtype), str(kv.shape[:2] + kv.shape[3:]), step.kv_kind, step.num_layers,
             step.num_callbacks, step.num_int4, step.num_int8_act,
             step.module.q8_gemv_isa() if step.num_int8_act else ""]
    return cpu_verdict.record_key(build_root().name, " ".join(ids), repr(facts))


def cpu_decode_step(parts: StepParts, label: str = ""):
    """The CPU step built from ``parts``: the C++ step (default), the opt-in inductor step
    (KVFLOW_CPU_COMPILE=1), or None (eager), with one log line saying which and why
    (starting with ``label``: a draft model passes "draft model: "). The caller installs
    a step's ``attn_builder`` in its step builder."""
    cfg = parts.config
    if cfg.parallel.world_size > 1:
        # The compiled step would have to trace the collectives; ranks run eager.
        logger.info("%scompiled CPU decode step off with %d ranks", label,
                    cfg.parallel.world_size)
        return None
    if cfg.device.enforce_eager:
        logger.info("compiled CPU decode step off (--enforce-eager): decoding eagerly")
        return None
    if envs.cpu_compile():
        # The compiled layers trace the fused backend's decode plan: windowed,
        # soft-capped and own-rotary layers (planned per request in Python) stay eager.
        if (reason := eager_reason(parts.model)) is not None:
            logger.info("%scompiled CPU decode step off (%s): decoding eagerly", label,
                        reason)
            return None
        from kvflow.cpu.compiled import compile_decode_step

        return compile_decode_step(parts)
    why_not = None
    if not envs.cpu_cpp_step():
        why_not = "KVFLOW_CPU_CPP_STEP=0"
    elif find_compiler() is None:
        why_not = "no C++ compiler found (install g++ or set CXX)"
    else:
        why_not = why_unsupported(parts.model, parts.kv_caches, cfg.speculative)
    if why_not is not None:
        logger.info("%sC++ CPU decode step off (%s): decoding eagerly", label, why_not)
        return None
    try:
        module, seconds = load_extension()
    except Exception as e:  # a broken toolchain must not stop the engine
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        logger.warning("%sbuilding the C++ CPU decode step failed, decoding eagerly: %s: %s",
                       label, type(e).__name__, first_line)
        return None
    step = None
    record = None
    try:
        step = CppDecodeStep(parts, module)
        tolerance = _tolerance(step, parts.kv_caches)
        limits = {"error": tolerance, "gemv_error": GEMV_TOLERANCE,
                  "write_error": WRITE_TOLERANCE, "eager_error": float("inf")}
        key = _verdict_key(parts, step, label)
        record = None if key is None else cpu_verdict.lookup(key, limits)
        if record is not None:
            error, gemv_error = record["error"], record["gemv_error"]
            step.write_error, step.eager_error = record["write_error"], record["eager_error"]
        else:
            error, gemv_error = _self_check(step, parts.kv_caches,
                                                parts.attn_spec.block_size)
    except Exception as e:  # e.g. a layout the C++ side rejects: eager, not a dead engine
        if step is not None:
            step.detach()
        logger.warning("%sthe C++ CPU decode step failed its warm-up check, decoding "
                       "eagerly: %s: %s", label, type(e).__name__, str(e).strip().splitlines()[0] if
                       str(e).strip() else "")
        return None
    if not error <= tolerance or not gemv_error <= GEMV_TOLERANCE or \
            not step.write_error <= WRITE_TOLERANCE:
        step.detach()
        logger.warning("%sthe C++ CPU decode step disagrees with eager (relative error %.2g, "
                       "tolerance %.0e; its GEMV against float64 %.2g, tolerance %.0e; "
                       "its stored K/V against eager's %.2g, tolerance %.0e), decoding "
                       "eagerly", label, error, tolerance, gemv_error, GEMV_TOLERANCE,
                       step.write_error, WRITE_TOLERANCE)
        return None
    if record is None and key is not None and parts.kv_caches.shape[2] >= 4:  # checked
        cpu_verdict.store(key, {"error": error, "gemv_error": gemv_error,
                                "write_error": step.write_error,
                                "eager_error": step.eager_error})
    head = step.head_gemv(True)
    lora_note = ""
    if parts.lora is not None:
        why_lora = why_no_lora(parts.model, parts.lora.slots.targets,
                               torch_dtype(cfg.model.dtype))
        if why_lora is None:
            step.attach_lora(parts.lora)
            lora_note = f"; LoRA deltas of {step.num_lora} linears"
        else:
            logger.info("%sC++ CPU decode step: LoRA deltas off (%s): steps with adapter "
                        "rows run eagerly", label, why_lora)
    logger.info("%sC++ CPU decode step: %d decoder layers in one call (%d quantized linears "
                "called back, %d of them by its own 4-bit GEMV%s%s; %s KV "
                "cache%s), every step; built/loaded in %.1f s (%s), self-check%s "
                "relative error %.1e (GEMV %.1e%s)", label, step.num_layers, step.num_callbacks,
                step.num_int4, ", the lm_head too" if head else "",
                f", {step.num_int8_act} on int8 activations ({step.module.q8_gemv_isa()})"
                if step.num_int8_act else "", step.kv_kind or "model-dtype", lora_note,
                seconds, build_root(), " (recorded at an earlier start of this build, model "
                "and configuration)" if record is not None else "", error, gemv_error, f"; over eager's own K/V {step.eager_error:.1e}, stored K/V "
                f"{step.write_error:.1e}" if step.kv_kind else "")
    return step
