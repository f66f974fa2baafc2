"""Per-GPU model shapes under tensor parallelism, and the cost of one engine step.

Two numbers per step: the roofline ``bound`` (bytes over HBM bandwidth versus FLOPs over
the matmul rate, whichever is larger: a floor no engine beats) and ``predicted``, which
adds the measured overheads of ``Efficiency`` term by term (GEMMs, attention, the small
per-layer kernels, per-step work, tensor-parallel all-reduces, and the host floor of
steps that run without CUDA graphs).

Tensor parallelism follows the Megatron layout kvflow's ``layers/`` are built for: q/k/v
and gate/up split by columns, o and down by rows (one all-reduce after each), embedding
and lm_head split over the vocabulary; KV heads are split across GPUs, or replicated
when there are fewer KV heads than GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvflow.config import DTYPE_BYTES, ModelArchConfig
from kvflow.errors import InvalidParameterError
from kvflow.plan.efficiency import Efficiency
from kvflow.plan.gpus import GpuSpec
from kvflow.utils import cdiv

DTYPE_ALIASES = {"fp32": "float32", "float32": "float32", "float": "float32",
                 "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
                 "float16": "float16", "half": "float16", "fp8": "fp8", "fp8_e4m3": "fp8",
                 "fp8_e5m2": "fp8", "int8": "int8"}
KV_ONLY_DTYPES = ("fp8", "int8")  # KV cache storage, not weights
# An int8 KV cache (--kv-cache-dtype int8) keeps a float32 scale per token, KV head,
# K and V beside its one-byte values (kvflow/worker/kv_cache.py).
INT8_KV_SCALE_BYTES = 4


def kv_bytes_per_head(kv_dtype: str, head_dim: int) -> int:
    """Bytes of one token's K (or V) of one KV head in a cache of ``kv_dtype``."""
    if kv_dtype == "int8":
        return head_dim + INT8_KV_SCALE_BYTES
    return head_dim * DTYPE_BYTES[kv_dtype]


def canonical_dtype(name: str, param: str, allow_fp8: bool) -> str:
    """'bf16' -> 'bfloat16' etc.; fp8 and int8 only where allowed (the KV cache)."""
    dtype = DTYPE_ALIASES.get(str(name).strip().lower())
    allowed = "bf16, fp16, fp32, fp8 or int8" if allow_fp8 else "bf16, fp16 or fp32"
    if dtype is None or (dtype in KV_ONLY_DTYPES and not allow_fp8):
        raise InvalidParameterError(f"{param} must be {allowed}, got {name!r}", param=param)
    return dtype


@dataclass(frozen=True)
class ShardedModel:
    """What one GPU of a tensor-parallel group holds and computes."""

    arch: ModelArchConfig
    """The whole model's architecture."""
    tp: int
    """Tensor-parallel size (GPUs per replica)."""
    dtype: str
    """Weights and activations: float32, bfloat16 or float16."""
    kv_dtype: str
    """KV cache values: float32, bfloat16, float16 or fp8."""
    stored_bytes_per_param: float | None = None
    """Bytes per weight as stored (a GGUF file: its tensors' bytes over their elements,
    e.g. 0.63 for Q4_1); None: ``dtype``'s size."""

    def __post_init__(self) -> None:
        a, tp = self.arch, self.tp
        param = "tensor_parallel_size"
        if tp < 1:
            raise InvalidParameterError(f"{param} must be >= 1, got {tp}", param=param)
        if a.num_attention_heads % tp:
            raise InvalidParameterError(
                f"{param}={tp} does not divide the model's {a.num_attention_heads} attention "
                f"heads; use a divisor of {a.num_attention_heads}", param=param)
        kvh = a.num_key_value_heads
        if (kvh >= tp and kvh % tp) or (kvh < tp and tp % kvh):
            raise InvalidParameterError(
                f"{param}={tp} cannot split {kvh} KV heads evenly (nor replicate them "
                f"evenly); use a divisor or a multiple of {kvh}", param=param)
        if a.num_experts and a.moe_intermediate_size % tp:
            raise InvalidParameterError(
                f"{param}={tp} does not divide moe_intermediate_size="
                f"{a.moe_intermediate_size}", param=param)
        if a.intermediate_size % tp:
            raise InvalidParameterError(
                f"{param}={tp} does not divide intermediate_size={a.intermediate_size}",
                param=param)
        for name in ("dtype", "kv_dtype"):
            if getattr(self, name) not in DTYPE_BYTES and not (
                    name == "kv_dtype" and self.kv_dtype == "int8"):
                raise InvalidParameterError(f"unknown {name} {getattr(self, name)!r}",
                                            param=name)

    # --- shapes per GPU ------------------------------------------------------------------
    @property
    def q_heads(self) -> int:
        return self.arch.num_attention_heads // self.tp

    @property
    def kv_heads(self) -> int:
        """KV heads on one GPU: split, or one replicated head when KV heads < TP."""
        return max(1, self.arch.num_key_value_heads // self.tp)

    @property
    def kv_replicas(self) -> int:
        """How many GPUs hold a copy of each KV head (1: no replication)."""
        return max(1, self.tp // self.arch.num_key_value_heads)

    @property
    def vocab(self) -> int:
        return cdiv(self.arch.vocab_size, self.tp)

    @property
    def intermediate(self) -> int:
        return self.arch.intermediate_size // self.tp

    @property
    def layer_linear_params(self) -> int:
        a, d = self.arch, self.arch.head_dim
        qkv_out = (self.q_heads + 2 * self.kv_heads) * d
        bias = qkv_out if a.attention_bias else 0
        return (a.hidden_size * qkv_out + bias + self.q_heads * d * a.hidden_size
                + 3 * a.hidden_size * self.intermediate)

    @property
    def layer_norm_params(self) -> int:
        return 2 * self.arch.hidden_size + (2 * self.arch.head_dim if self.arch.qk_norm else 0)

    # --- mixtures of experts: each GPU holds 1/tp of every layer's experts (whole with
    # expert parallelism, sliced without: the same bytes) and a step reads only the
    # experts its tokens were routed to.
    @property
    def moe_layers(self) -> int:
        a = self.arch
        return sum(a.is_moe_layer(i) for i in range(a.num_hidden_layers))

    @property
    def expert_params(self) -> int:
        """One expert's gate, up and down on one GPU."""
        return 3 * self.arch.hidden_size * self.arch.moe_intermediate_size // self.tp

    @property
    def moe_layer_fixed_params(self) -> int:
        """An MoE layer's attention, router and shared expert (read by every step)."""
        a = self.arch
        shared = (3 * a.hidden_size * a.shared_expert_intermediate_size // self.tp
                  + a.hidden_size if a.shared_expert_intermediate_size else 0)
        return (self.layer_linear_params - 3 * a.hidden_size * self.intermediate
                + a.num_experts * a.hidden_size + shared)

    def linear_read_params(self, tokens: int) -> int:
        """Linear-layer parameters one step of ``tokens`` tokens reads on one GPU: every
        dense layer, and of each MoE layer the experts its tokens are expected to touch
        under uniform routing (E (1 - (1 - k/E)^tokens); tokens 0: all of them)."""
        a = self.arch
        dense = (a.num_hidden_layers - self.moe_layers) * self.layer_linear_params
        if not self.moe_layers:
            return dense
        e, k = a.num_experts, a.num_experts_per_tok
        touched = e if tokens <= 0 else e * (1.0 - (1.0 - k / e) ** tokens)
        return dense + self.moe_layers * round(self.moe_layer_fixed_params
                                               + touched * self.expert_params)

    @property
    def active_linear_params(self) -> int:
        """Linear-layer parameters one token multiplies (its k experts per MoE layer)."""
        a = self.arch
        return ((a.num_hidden_layers - self.moe_layers) * self.layer_linear_params
                + self.moe_layers * (self.moe_layer_fixed_params
                                     + a.num_experts_per_tok * self.expert_params))

    @property
    def num_params(self) -> int:
        """Parameters on one GPU (equals ``arch.num_params`` at TP 1)."""
        a = self.arch
        emb = self.vocab * a.hidden_size * (1 if a.tie_word_embeddings else 2)
        return (self.linear_read_params(0) + a.num_hidden_layers * self.layer_norm_params
                + emb + a.hidden_size)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def weight_bytes(self) -> int:
        return round(self.num_params * self.weight_param_bytes)

    @property
    def weight_param_bytes(self) -> float:
        """Bytes per weight in memory: as stored, else the dtype's."""
        return self.stored_bytes_per_param or self.dtype_bytes

    @property
    def decode_weight_read_bytes(self) -> int:
        """Weights one step reads in full: all but the input embedding table, of which a
        step gathers only its tokens' rows (a tied table is read whole as the lm_head);
        of a mixture of experts, all experts (see ``weight_read_bytes``)."""
        return self.weight_read_bytes(0)

    def weight_read_bytes(self, tokens: int) -> int:
        """Weights a step of ``tokens`` tokens reads (a dense model: all of them but the
        input embedding table; MoE: the experts its tokens touch)."""
        a = self.arch
        read = (self.linear_read_params(tokens) + a.num_hidden_layers
                * self.layer_norm_params + self.vocab * a.hidden_size + a.hidden_size)
        return round(read * self.weight_param_bytes)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes of one token on one GPU."""
        return (2 * self.arch.num_hidden_layers * self.kv_heads
                * kv_bytes_per_head(self.kv_dtype, self.arch.head_dim))

    @property
    def model_kv_bytes_per_token(self) -> int:
        """2 * layers * kv_heads * head_dim * bytes: one token of the whole model."""
        a = self.arch
        return (2 * a.num_hidden_layers * a.num_key_value_heads
                * kv_bytes_per_head(self.kv_dtype, a.head_dim))

    def attended_context(self, context: float) -> float:
        """Keys one query reads per layer on average at ``context`` tokens: a windowed
        layer reads at most its window."""
        w = self.arch.layer_windows
        return sum(context if x is None else min(context, x) for x in w) / len(w)

    def held_tokens(self, length: int, block_size: int) -> int:
        """KV tokens one ``length``-token request holds at its end: all of them, or, when
        every layer is windowed, the window and the block it starts in (blocks behind
        it are freed; see core/kv_cache_manager.py). One block table serves all layers,
        so a model with any full-attention layer holds everything."""
        windows = set(self.arch.layer_windows)
        if len(windows) != 1 or None in windows:
            return length
        return min(length, windows.pop() + block_size)

    @property
    def layer_elementwise_bytes_per_token(self) -> int:
        """Bytes the small kernels move per token and layer: 2 fused add+RMSNorms
        (read x and residual, write both), rotary + KV write, SiLU-and-mul."""
        a, b = self.arch, self.dtype_bytes
        q, kv = self.q_heads * a.head_dim, self.kv_heads * a.head_dim
        return (b * (8 * a.hidden_size + 2 * q + 3 * kv + 3 * self.intermediate)
                + 2 * self.kv_heads * kv_bytes_per_head(self.kv_dtype, a.head_dim))


@dataclass(frozen=True)
class StepCost:
    """Cost of one engine step on one GPU."""

    bytes: float
    """HBM bytes the step must move at least (weights read once, KV read and written)."""
    flops: float
    """FLOPs of the step (linear layers, lm_head rows, attention)."""
    bound_s: float
    """Roofline: max(bytes / bandwidth, flops / matmul rate)."""
    binding: str
    """Which side of the roofline binds: memory or compute."""
    predicted_s: float
    """The bound's terms at measured efficiencies, plus fixed costs."""
    allreduce_bytes: float = 0.0
    """Bytes one GPU sends in the step's all-reduces (ring: 2(N-1)/N of each message)."""
    allreduce_count: int = 0
    """All-reduces in the step: two per layer (after o_proj and after down_proj), plus
    the vocabulary-parallel embedding's; the logits gather is not counted."""
    allreduce_message_bytes: float = 0.0
    """Size of each of those messages: tokens x hidden x dtype bytes."""
    breakdown: dict[str, float] = field(default_factory=dict)
    """Predicted seconds by part: gemm, attention, small_kernels, per_step, allreduce,
    host_floor (extra time when eager kernel launches outrun the GPU)."""


def _knee(t_bytes: float, t_flops: float, p: float) -> float:
    if math.isinf(p):
        return max(t_bytes, t_flops)
    return (t_bytes ** p + t_flops ** p) ** (1.0 / p)


def step_cost(m: ShardedModel, gpu: GpuSpec, eff: Efficiency, *, decode_seqs: int = 0,
              decode_context: float = 0.0, prefill: tuple[tuple[int, int], ...] = (),
              cuda_graph: bool = True) -> StepCost:
    """One step: ``decode_seqs`` sequences decoding one token each at ``decode_context``
    tokens of context, plus prefill chunks given as (chunk tokens, tokens already cached).
    ``cuda_graph``: a decode-only step replays a CUDA graph; other steps run eagerly."""
    a, L = m.arch, m.arch.num_hidden_layers
    bw, rate = gpu.hbm_bytes_per_s, gpu.flops_per_s(m.dtype)
    tokens = decode_seqs + sum(c for c, _ in prefill)
    rows = decode_seqs + len(prefill)  # logits rows: every decode and each prompt's last
    qdim = m.q_heads * a.head_dim
    kv_tok = m.kv_bytes_per_token

    read = m.weight_read_bytes(tokens)
    weights = read + tokens * a.hidden_size * m.dtype_bytes
    kv_decode = decode_seqs * m.attended_context(decode_context) * kv_tok  # windows cap it
    kv_prefix = sum(p for _, p in prefill) * kv_tok
    kv_write = tokens * kv_tok
    gemm_flops = (2.0 * tokens * m.active_linear_params
                  + 2.0 * rows * m.vocab * a.hidden_size)
    attn_decode_flops = 4.0 * qdim * m.attended_context(decode_context) * decode_seqs * L
    attn_prefill_flops = sum(4.0 * qdim * (c * p + c * c / 2) * L for c, p in prefill)
    total_bytes = weights + kv_decode + kv_prefix + kv_write
    total_flops = gemm_flops + attn_decode_flops + attn_prefill_flops
    t_mem, t_flops = total_bytes / bw, total_flops / rate

    parts = {
        "gemm": _knee(read / (bw * eff.gemm_bandwidth),
                      gemm_flops / (rate * eff.gemm_flops), eff.gemm_knee),
        "attention": (L * eff.attn_layer_fixed_s
                      + (kv_decode + kv_prefix) / (bw * eff.attn_decode_bandwidth)
                      + attn_prefill_flops / (rate * eff.attn_prefill_flops)),
        "small_kernels": L * (eff.small_layer_fixed_s + tokens
                              * m.layer_elementwise_bytes_per_token
                              / (bw * eff.elementwise_bandwidth)),
        "per_step": eff.step_fixed_s + rows * m.vocab * (2 * m.dtype_bytes + 8) / bw,
    }
    ar_bytes = message = 0.0
    count = 0
    if m.tp > 1:
        message = tokens * a.hidden_size * m.dtype_bytes
        count = 2 * L + 1
        ar_bytes = count * message * 2 * (m.tp - 1) / m.tp
        parts["allreduce"] = count * gpu.link_latency_s + ar_bytes / gpu.link_bytes_per_s
    gpu_time = sum(parts.values())
    eager = bool(prefill) or not cuda_graph
    launch = L * eff.eager_launch_s_per_layer if eager else 0.0
    parts["host_floor"] = max(0.0, launch - gpu_time)
    return StepCost(bytes=total_bytes, flops=total_flops, bound_s=max(t_mem, t_flops),
                    binding="memory" if t_mem >= t_flops else "compute",
                    predicted_s=gpu_time + parts["host_floor"], allreduce_bytes=ar_bytes,
                    allreduce_count=count, allreduce_message_bytes=message,
                    breakdown=parts)


def decode_step(m: ShardedModel, gpu: GpuSpec, eff: Efficiency, batch: int,
                context: float) -> StepCost:
    """A decode-only step of ``batch`` sequences at ``context`` tokens (CUDA graph)."""
    return step_cost(m, gpu, eff, decode_seqs=batch, decode_context=context)


def prefill_chunks(prompt_len: int,
                   max_num_batched_tokens: int) -> tuple[tuple[int, int], ...]:
    """How the scheduler splits one prompt alone: chunks of the token budget."""
    chunks, done = [], 0
    while done < prompt_len:
        c = min(max_num_batched_tokens, prompt_len - done)
        chunks.append((c, done))
        done += c
    return tuple(chunks)


def prefill_costs(m: ShardedModel, gpu: GpuSpec, eff: Efficiency, prompt_len: int,
                  max_num_batched_tokens: int) -> list[StepCost]:
    """One prompt on an idle engine, step by step (chunked by the token budget)."""
    return [step_cost(m, gpu, eff, prefill=(chunk,))
            for chunk in prefill_chunks(prompt_len, max_num_batched_tokens)]
