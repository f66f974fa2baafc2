"""``build_plan``: memory, concurrency, decode by batch size and prefill, for one setup."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.config import GiB, ModelArchConfig
from kvflow.errors import InvalidParameterError, require
from kvflow.plan.efficiency import H200_CALIBRATED, Efficiency
from kvflow.plan.gpus import GpuSpec
from kvflow.lora.memory import lora_slot_bytes
from kvflow.plan.memory import MemoryPlan, plan_memory
from kvflow.plan.model import DTYPE_BYTES, ShardedModel, StepCost, decode_step, prefill_costs
from kvflow.plan.simulate import OfflineEstimate, simulate_offline

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class PlanInputs:
    """A model on a GPU setup, and the workload to plan for."""

    model: str
    """The model as the user named it (preset, Hugging Face directory or GGUF file)."""
    arch: ModelArchConfig
    """Its architecture (``kvflow.models.registry.resolve_model``)."""
    gpu: GpuSpec
    """One GPU of the setup (every GPU of a tensor-parallel group is alike)."""
    dtype: str = "bfloat16"
    """Weights and activations: float32, bfloat16 or float16."""
    kv_dtype: str | None = None
    """KV cache values: float32, bfloat16, float16 or fp8; None: same as ``dtype``."""
    tensor_parallel_size: int = 1
    """GPUs one model replica is split over."""
    gpu_memory_utilization: float = 0.9
    """Fraction of each GPU's memory the engine may use (the engine's default)."""
    max_model_len: int | None = None
    """Longest sequence; None: the model's context length (the engine's default)."""
    input_len: int = 128
    """Prompt tokens per request (default: the GPU-A workload)."""
    output_len: int = 256
    """Generated tokens per request (default: the GPU-A workload)."""
    max_num_batched_tokens: int = 8192
    """Token budget of one step (the engine's GPU default): prompts longer than this are
    prefilled in chunks, and it sizes the activation memory."""
    max_num_seqs: int = 256
    """Most requests running at once (the engine's GPU default): sizes the sampler's
    memory and the largest CUDA graph."""
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    """Decode batch sizes to tabulate."""
    max_loras: int = 0
    """LoRA device slots (``--max-loras`` with ``--enable-lora``); 0: LoRA off."""
    max_lora_rank: int = 16
    """The rank every LoRA slot is sized for."""
    num_prompts: int | None = None
    """Also estimate an offline run of this many requests, all sent at once."""
    block_size: int = 16
    """Tokens per KV block."""
    efficiency: Efficiency = field(default_factory=lambda: H200_CALIBRATED)
    """Measured overheads used for the predicted times."""
    stored_bytes_per_param: float | None = None
    """Bytes per weight as the model file stores them (GGUF: its real tensor bytes);
    None: ``dtype``'s size."""

    def __post_init__(self) -> None:
        require(self.dtype in ("float32", "bfloat16", "float16"), "dtype",
                 f"must be bf16, fp16 or fp32, got {self.dtype!r}")
        require(self.kv_dtype is None or self.kv_dtype in DTYPE_BYTES
                or self.kv_dtype == "int8", "kv_dtype",
                f"must be bf16, fp16, fp32, fp8 or int8, got {self.kv_dtype!r}")
        require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
                 f"must be in (0, 1], got {self.gpu_memory_utilization}")
        require(self.input_len >= 1, "input_len", f"must be >= 1, got {self.input_len}")
        require(self.output_len >= 1, "output_len", f"must be >= 1, got {self.output_len}")
        if self.max_model_len is not None:
            require(self.max_model_len >= 1, "max_model_len",
                     f"must be >= 1, got {self.max_model_len}")
        require(self.input_len + self.output_len <= self.model_len, "input_len",
                 f"+ output_len = {self.input_len + self.output_len} exceeds max_model_len="
                 f"{self.model_len}; shorten them or raise --max-model-len")
        require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
                 f"must be >= 1, got {self.max_num_batched_tokens}")
        require(self.max_num_seqs >= 1, "max_num_seqs",
                 f"must be >= 1, got {self.max_num_seqs}")
        require(len(self.batch_sizes) > 0, "batch_sizes", "must name at least one size")
        require(all(b >= 1 for b in self.batch_sizes), "batch_sizes",
                 f"must all be >= 1, got {list(self.batch_sizes)}")
        if self.num_prompts is not None:
            require(self.num_prompts >= 1, "num_prompts",
                     f"must be >= 1, got {self.num_prompts}")
        require(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256), "block_size",
                 f"must be a power of two in [1, 256], got {self.block_size}")

    @property
    def model_len(self) -> int:
        return self.max_model_len or self.arch.max_position_embeddings

    @property
    def average_context(self) -> float:
        """Mean context of a decode step over a request's life: input + output / 2."""
        return self.input_len + self.output_len / 2


@dataclass(frozen=True)
class DecodeRow:
    """One decode batch size."""

    batch: int
    context: float
    fits: bool
    """The KV cache holds ``batch`` requests at full length (input + output)."""
    cost: StepCost

    @property
    def bound_ms(self) -> float:
        return self.cost.bound_s * 1e3

    @property
    def predicted_ms(self) -> float:
        return self.cost.predicted_s * 1e3

    @property
    def stream_tokens_per_s(self) -> float:
        return 1.0 / self.cost.predicted_s

    @property
    def total_tokens_per_s(self) -> float:
        return self.batch / self.cost.predicted_s

    @property
    def bound_total_tokens_per_s(self) -> float:
        return self.batch / self.cost.bound_s


@dataclass(frozen=True)
class PrefillEstimate:
    """One prompt of ``input_len`` tokens on an idle engine."""

    tokens: int
    steps: tuple[StepCost, ...]

    @property
    def bound_s(self) -> float:
        return sum(s.bound_s for s in self.steps)

    @property
    def binding(self) -> str:
        return max(self.steps, key=lambda s: s.bound_s).binding

    @property
    def gpu_s(self) -> float:
        """Predicted GPU time of the prefill steps."""
        return sum(s.predicted_s - s.breakdown["host_floor"] for s in self.steps)

    @property
    def ttft_s(self) -> float:
        """Predicted time to first token: the steps, eager launches included."""
        return sum(s.predicted_s for s in self.steps)


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    model: ShardedModel
    memory: MemoryPlan
    decode: tuple[DecodeRow, ...]
    prefill: PrefillEstimate
    notes: tuple[str, ...]
    offline: OfflineEstimate | None = None

    @property
    def max_batch(self) -> int:
        """Requests of input + output tokens the KV cache holds at once."""
        return self.memory.max_sequences(self.model.held_tokens(
            self.inputs.input_len + self.inputs.output_len, self.inputs.block_size))

    @property
    def concurrency_at_max_model_len(self) -> float:
        """KV tokens / max_model_len, as the engine logs it."""
        return self.memory.kv_tokens / self.inputs.model_len


def build_plan(inputs: PlanInputs) -> Plan:
    kv_dtype = inputs.kv_dtype or inputs.dtype
    m = ShardedModel(inputs.arch, inputs.tensor_parallel_size, inputs.dtype, kv_dtype,
                     inputs.stored_bytes_per_param)
    eff = inputs.efficiency
    mem = _memory(m, inputs)
    seq_len = inputs.input_len + inputs.output_len
    max_batch = mem.max_sequences(m.held_tokens(seq_len, inputs.block_size))
    rows = tuple(DecodeRow(batch=b, context=inputs.average_context, fits=b <= max_batch,
                           cost=decode_step(m, inputs.gpu, eff, b, inputs.average_context))
                 for b in sorted(set(inputs.batch_sizes)))
    prefill = PrefillEstimate(inputs.input_len, tuple(prefill_costs(
        m, inputs.gpu, eff, inputs.input_len, inputs.max_num_batched_tokens)))
    offline = None
    if inputs.num_prompts:
        offline = simulate_offline(m, inputs.gpu, eff, mem, num_prompts=inputs.num_prompts,
                                   input_len=inputs.input_len, output_len=inputs.output_len,
                                   max_num_batched_tokens=inputs.max_num_batched_tokens,
                                   max_num_seqs=inputs.max_num_seqs)
    return Plan(inputs, m, mem, rows, prefill, tuple(_notes(inputs, m, mem)), offline)


def _memory(m: ShardedModel, inputs: PlanInputs) -> MemoryPlan:
    return plan_memory(m, inputs.efficiency, total_bytes=inputs.gpu.memory_bytes,
                       gpu_memory_utilization=inputs.gpu_memory_utilization,
                       max_model_len=inputs.model_len,
                       max_num_batched_tokens=inputs.max_num_batched_tokens,
                       max_num_seqs=inputs.max_num_seqs, block_size=inputs.block_size,
                       lora_bytes=lora_slot_bytes(inputs.arch, m.tp, inputs.max_loras,
                                                  inputs.max_lora_rank, m.dtype_bytes))


def _notes(inputs: PlanInputs, m: ShardedModel, mem: MemoryPlan) -> list[str]:
    notes = []
    one_seq = mem.max_sequences(inputs.model_len)
    if mem.kv_budget_bytes <= 0:
        tp = _smallest_fitting_tp(inputs)
        hint = (f"--tensor-parallel-size {tp} fits" if tp else
                "no tensor-parallel size up to 64 fits")
        notes.append(f"does not fit: weights {mem.weight_bytes / GiB:.1f} GiB + activations "
                     f"and reserves exceed the usable {mem.usable_bytes / GiB:.1f} GiB "
                     "per GPU "
                     f"({hint}; or a GPU with more memory, or a smaller --dtype)")
    elif one_seq < 1:
        notes.append(f"the KV cache ({mem.kv_tokens} tokens) cannot hold one max_model_len="
                     f"{inputs.model_len} sequence: the engine would refuse to start; lower "
                     "--max-model-len")
    over = [b for b in inputs.batch_sizes if b > inputs.max_num_seqs]
    if over:
        notes.append(f"batch sizes above --max-num-seqs {inputs.max_num_seqs} "
                     f"({', '.join(map(str, sorted(set(over))))}) need the engine started "
                     "with a larger --max-num-seqs")
    if m.kv_dtype != m.dtype and m.kv_dtype not in ("fp8", "int8"):
        notes.append(f"KV cache in {m.kv_dtype} is a what-if: kvflow's engine stores KV in "
                     "the model dtype, int8 or fp8 (--kv-cache-dtype)")
    if m.tp > 1:
        notes.append("tensor-parallel figures model kvflow's Megatron layout; all-reduce "
                     "times use the datasheet link bandwidth and an assumed latency "
                     "(measure them with kvflow bench allreduce --device cuda)")
        if m.kv_replicas > 1:
            notes.append(f"{inputs.arch.num_key_value_heads} KV heads on {m.tp} GPUs: each "
                         f"KV head is replicated on {m.kv_replicas} GPUs")
    notes += window_notes(inputs, m)
    if inputs.gpu.name != "H200":
        notes.append("predicted times use overheads measured on the H200; on other GPUs "
                     "they are unvalidated")
    return notes


def window_notes(inputs: PlanInputs, m: ShardedModel) -> list[str]:
    """What sliding windows change: the KV a long request holds, and what they free."""
    windows = m.arch.layer_windows
    local = [w for w in windows if w is not None]
    if not local:
        return []
    n, length = len(windows), inputs.model_len
    held = m.held_tokens(length, inputs.block_size)
    if len(local) == n:
        return [f"sliding window {local[0]} on every layer: a request holds at most "
                f"{held} tokens of KV ({held * m.model_kv_bytes_per_token / GiB:.2f} GiB) "
                f"whatever its length; blocks behind the window are freed"]
    need = sum(min(length, w) for w in local) + (n - len(local)) * length  # layer-tokens
    return [f"{len(local)} of {n} layers local (window {max(local)}): kvflow's block table "
            f"is shared by all layers, so a {length}-token request holds "
            f"{length * m.model_kv_bytes_per_token / GiB:.2f} GiB of KV; a cache per layer "
            f"type would hold {need / n * m.model_kv_bytes_per_token / GiB:.2f} GiB"]


def _smallest_fitting_tp(inputs: PlanInputs) -> int | None:
    for tp in (2, 4, 8, 16, 32, 64):
        if tp <= inputs.tensor_parallel_size:
            continue
        try:
            m = ShardedModel(inputs.arch, tp, inputs.dtype, inputs.kv_dtype or inputs.dtype,
                             inputs.stored_bytes_per_param)
        except InvalidParameterError:
            continue
        if _memory(m, inputs).max_sequences(inputs.model_len) >= 1:
            return tp
    return None
