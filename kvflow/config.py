"""Engine configuration: frozen dataclasses, one docstring per field, checked on creation.

This module is pure Python (no torch): the scheduler in ``kvflow.core`` reads it.
``kvflow.engine.args.EngineArgs`` is the one place that builds these from user input.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

# The dtype table and ModelArchConfig live in their own modules; these names stay
# importable from here, where most of the code looks for them.
from kvflow.dtypes import DTYPE_BYTES, KV_CACHE_DTYPES, MODEL_DTYPES, torch_dtype  # noqa: F401
from kvflow.errors import InvalidParameterError, require
from kvflow.model_arch import ModelArchConfig  # noqa: F401
from kvflow.pooling.config import PoolerConfig
from kvflow.lora.config import LoRAConfig

GiB = 1 << 30

PREEMPTION_MODES = ("recompute", "swap", "auto")


def check_preemption_mode(mode: str) -> None:
    """The one check of a preemption mode (CacheConfig and the scheduler's SwapPolicy)."""
    require(mode in PREEMPTION_MODES, "preemption_mode",
            f"must be {', '.join(PREEMPTION_MODES[:-1])} or {PREEMPTION_MODES[-1]}, "
            f"got {mode!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Which model to run and how."""

    model: str
    """The model as the user named it (preset name, HF directory or GGUF file)."""
    path: str | None
    """Resolved local path of the weights; None for dummy weights."""
    load_format: str
    """hf (safetensors directory), gguf or dummy (random weights)."""
    arch: ModelArchConfig
    """Architecture hyperparameters."""
    dtype: str
    """float32, bfloat16 or float16 (never 'auto' here: EngineArgs resolves it)."""
    max_model_len: int
    """Longest sequence (prompt + output) a request may have."""
    tokenizer: str | None = None
    """Path of the tokenizer (HF directory or GGUF file); None: token ids only."""
    served_model_name: str = ""
    """Name reported by the API; defaults to ``model``."""
    seed: int = 0
    """Seed for dummy weights and for requests without their own seed."""
    generation_defaults: tuple[tuple[str, object], ...] = ()
    """Recommended sampling settings applied to the fields a request leaves unset, as
    sorted (SamplingParams field, value) pairs (see ``generation_source``)."""
    generation_source: str = "none"
    """Where generation_defaults came from: a generation_config.json path, GGUF metadata,
    kvflow's registry entry of an embedded model, or none."""
    max_tokens_default: int | None = None
    """Output tokens for a request that leaves max_tokens unset; None: up to
    max_model_len (as in the OpenAI API)."""
    chat_template: str | None = None
    """Jinja chat template replacing the model's default one (--chat-template, read from
    its file by EngineArgs); None: the model's."""
    max_tokens_source: str = "none"
    """Where max_tokens_default came from (--max-tokens-default or kvflow's registry)."""
    repetition_guard: int = 0
    """Repeated-output span (tokens) that ends a request leaving repetition_guard unset
    (kvflow/core/repetition.py); 0: off."""
    quantization: str = "auto"
    """Weight storage: auto (a GGUF file on CPU keeps its blocks; anything else is dense),
    none (dense in ``dtype``), int8, int4 (quantized at load), gguf, or fp8 (W8A8).
    Resolved into a QuantizationConfig once, at load (``kvflow.layers.quantization``)."""
    quantization_group_size: int = 32
    """int4: input elements per scale / zero point (32, 64 or 128)."""
    quantization_symmetric: bool = False
    """int4: scale only (zero point fixed) instead of a zero point per group."""
    llm_int8_threshold: float = 6.0
    """llm-int8: input columns whose absolute maximum in a step exceeds this are
    multiplied in the model dtype, the rest in int8."""
    lm_head_quantization: str = "auto"
    """The lm_head of a model quantized at load: auto (the method's choice: int8 for int8
    / int4 weight-only, the model dtype for fp8 and int8 W8A8), none (the model dtype) or
    int8 (per output channel, weight-only)."""
    dtype_forced: bool = False
    """The user named ``dtype`` (so auto quantization keeps GGUF weights dense in it)."""

    def __post_init__(self) -> None:
        require(self.quantization in ("auto", "none", "int8", "int4", "gguf", "fp8",
                                      "fp8-block", "w8a8-int8", "llm-int8"),
                "quantization", f"must be auto, none, int8, int4, gguf, fp8, fp8-block, "
                f"w8a8-int8 or llm-int8, got {self.quantization!r}")
        require(self.llm_int8_threshold > 0, "llm_int8_threshold",
                f"must be > 0, got {self.llm_int8_threshold}")
        require(self.lm_head_quantization in ("auto", "none", "int8"), "lm_head_quantization",
                f"must be auto, none or int8, got {self.lm_head_quantization!r}")
        require(self.quantization_group_size in (32, 64, 128), "quantization_group_size",
                f"must be 32, 64 or 128, got {self.quantization_group_size}")
        require(self.load_format in ("hf", "gguf", "dummy"), "load_format",
                 f"must be hf, gguf or dummy, got {self.load_format!r}")
        require(self.dtype in MODEL_DTYPES, "dtype",
                 f"must be one of {sorted(MODEL_DTYPES)}, got {self.dtype!r}")
        require(self.max_model_len >= 1, "max_model_len", "must be >= 1")
        if self.max_tokens_default is not None:
            require(self.max_tokens_default >= 1, "max_tokens_default", "must be >= 1")
        require(isinstance(self.repetition_guard, int) and self.repetition_guard >= 0,
                "repetition_guard", f"must be an integer >= 0, got {self.repetition_guard!r}")

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    def generation_defaults_line(self) -> str:
        """One log line saying which sampling defaults are in force and why."""
        values = ", ".join(f"{k}={v}" for k, v in self.generation_defaults)
        cap = (f"max_tokens={self.max_tokens_default} (from {self.max_tokens_source})"
               if self.max_tokens_default else "max_tokens up to max_model_len")
        cap += (f"; repetition guard {self.repetition_guard} tokens" if self.repetition_guard
                else "; repetition guard off")
        if not values:
            return f"sampling defaults: none (temperature 1.0, no filters); {cap}"
        return f"sampling defaults: {values} (from {self.generation_source}); {cap}"


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing."""

    block_size: int = 16
    """Tokens per KV block."""
    gpu_memory_utilization: float = 0.9
    """Fraction of total GPU memory kvflow may use (weights + activations + KV cache)."""
    kv_cache_memory: int | None = None
    """KV cache budget in bytes. CPU default: 4 GiB, or half the available memory when that
    is less; more than is available is refused. On GPU, overrides profiling."""
    num_blocks_override: int | None = None
    """Use exactly this many KV blocks (tests, reproducible benchmarks)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes across requests."""
    preemption_mode: str = "recompute"
    """recompute (free the blocks, compute again later), swap (copy them to host memory
    and back) or auto (per request, whichever is estimated cheaper)."""
    swap_space: int = 4 * GiB
    """Host (pinned) memory for swapped-out KV blocks, in bytes (swap and auto modes)."""
    kv_layout: str = "paged"
    """paged (blocks allocated as a sequence grows) or contiguous (each request reserves
    max_model_len of KV at admission, as an engine without paging must: the ablation
    baseline; no prefix sharing)."""
    cache_dtype: str = "auto"
    """KV cache storage: auto (the model dtype), int8 (a float32 scale per token and KV
    head, stored beside the cache in the same block layout) or fp8 (E4M3, one scale per
    layer for K and one for V: 1.0 or the checkpoint's k_scale/v_scale)."""

    def __post_init__(self) -> None:
        require(self.cache_dtype in KV_CACHE_DTYPES, "cache_dtype",
                f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.cache_dtype!r}")
        require(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256), "block_size",
                 f"must be a power of two in [1, 256], got {self.block_size}")
        require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
                 f"must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None:
            require(self.kv_cache_memory > 0, "kv_cache_memory", "must be > 0 bytes")
        if self.num_blocks_override is not None:
            require(self.num_blocks_override >= 1, "num_blocks_override", "must be >= 1")
        check_preemption_mode(self.preemption_mode)
        require(self.swap_space >= 0, "swap_space", "must be >= 0 bytes")
        require(self.kv_layout in ("paged", "contiguous"), "kv_layout",
                 f"must be paged or contiguous, got {self.kv_layout!r}")
        require(self.kv_layout == "paged" or not self.enable_prefix_caching, "kv_layout",
                 "contiguous KV regions cannot share prefixes: add "
                 "--no-enable-prefix-caching")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_batched_tokens: int = 2048
    """Token budget of one engine step (prefill chunks plus decode tokens)."""
    max_num_seqs: int = 256
    """Most requests running at once."""
    max_model_len: int = 2048
    """Longest sequence (copied from ModelConfig)."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps so decodes keep flowing."""
    max_queued_requests: int | None = None
    """Refuse new requests once this many wait (server back-pressure); None: no limit."""
    async_scheduling: bool = False
    """Schedule and launch step N+1 while step N runs on the GPU (overlapped steps)."""
    batching: str = "continuous"
    """continuous (requests join and leave the running batch every step) or static (a
    batch forms only when the previous one has finished: the ablation baseline)."""
    target_tpot_ms: float | None = None
    """Latency target: cap each step's token budget and running batch so the predicted
    step time (learned online from measured steps) stays under this many milliseconds
    per output token; requests beyond that wait. None: no target."""
    target_ttft_ms: float | None = None
    """With target_tpot_ms: a request at the head of the queue that would miss this time
    to first token at the TPOT caps, and can still make it, is admitted with the prefill
    chunk it needs even if that step runs over the TPOT plan. None: no TTFT target."""
    target_step_ms: float | None = None
    """Smooth steps: size each step's token budget so its predicted time (the latency
    target's step-time model) stays under this many milliseconds. Prompt chunks shrink to
    fit; unlike target_tpot_ms the running batch is not capped, every running request
    decodes every step and a minimum prompt chunk always advances. None: off."""
    max_seqs_per_request: int | None = None
    """Most running sequences one client request's samples (n > 1) may hold at once;
    its other samples wait while later requests are admitted. None: max_num_seqs // 8,
    at least 16 (or max_num_seqs if smaller)."""

    @property
    def max_prompt_chunk(self) -> int | None:
        """The most prompt tokens one step computes for a request: the step budget with
        chunked prefill, else None (the whole prompt at once)."""
        return self.max_num_batched_tokens if self.enable_chunked_prefill else None

    def __post_init__(self) -> None:
        require(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        require(self.batching in ("continuous", "static"), "batching",
                 f"must be continuous or static, got {self.batching!r}")
        if self.target_tpot_ms is not None:
            require(self.target_tpot_ms > 0, "target_tpot_ms", "must be > 0 milliseconds")
        if self.target_ttft_ms is not None:
            require(self.target_ttft_ms > 0, "target_ttft_ms", "must be > 0 milliseconds")
            require(self.target_tpot_ms is not None, "target_ttft_ms",
                    "needs --target-tpot-ms: without a TPOT target nothing holds a request "
                    "back from its first token but the engine's own limits")
        if self.target_step_ms is not None:
            require(self.target_step_ms > 0, "target_step_ms", "must be > 0 milliseconds")
        if self.max_seqs_per_request is not None:
            require(self.max_seqs_per_request >= 1, "max_seqs_per_request", "must be >= 1")
        require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        if not self.enable_chunked_prefill:
            require(self.max_num_batched_tokens >= self.max_model_len,
                     "max_num_batched_tokens",
                     f"must be >= max_model_len ({self.max_model_len}) without chunked prefill")


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs."""

    device: str = "cpu"
    """cpu or cuda (cuda:N for a given GPU)."""
    enforce_eager: bool = False
    """Never capture CUDA graphs."""
    cpu_step_threads: str = "adaptive"
    """CPU: adaptive (each size class of step runs on one torch thread or all of them,
    whichever measures faster; kvflow/cpu/threads.py) or all (every step on all
    threads)."""
    deterministic: bool = False
    """Batch-invariant kernels on the GPU (docs/determinism.md): every row of a step is
    computed in an order that does not depend on the other rows. The CPU step is
    batch-invariant without it."""

    def __post_init__(self) -> None:
        require(self.device == "cpu" or self.device.startswith("cuda"), "device",
                 f"must be cpu or cuda[:N], got {self.device!r}")
        require(self.cpu_step_threads in ("adaptive", "all"), "cpu_step_threads",
                f"must be adaptive or all, got {self.cpu_step_threads!r}")

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")


SPEC_METHODS = ("ngram", "draft_model", "medusa", "eagle_mlp")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``--speculative-config``, JSON shaped like vLLM's)."""

    method: str
    """How drafts are proposed: ngram (prompt lookup: continue the longest recent n-gram
    that occurred earlier in the request's own tokens; no extra model) or draft_model (a
    smaller model with the same vocabulary runs k steps ahead of the target) or medusa
    (heads on the target's last hidden state guess the next k tokens at once) or
    eagle_mlp (a small head trained with ``kvflow train-eagle`` predicts the target's next
    hidden state from its last one and the emitted token, k times in a row)."""
    num_speculative_tokens: int
    """Draft tokens proposed per request per step (k); a step yields 1 to k + 1 tokens."""
    prompt_lookup_min: int = 1
    """ngram: shortest suffix n-gram to look up."""
    prompt_lookup_max: int = 4
    """ngram: longest suffix n-gram to look up (longer matches are tried first)."""
    disable_by_batch_size: int | None = 8
    """No drafts while more than this many requests run: a large batch already reads the
    weights once for many tokens, and verifying drafts would only add compute. None:
    always speculate."""
    model: str | None = None
    """draft_model: the draft (a preset name, Hugging Face directory or GGUF file, like
    ``--model``) with the target's vocabulary. Omitted together with ``draft_num_layers``:
    the target model itself, cut to its first layers. medusa: the heads' directory
    (config.json and medusa_lm_head.safetensors). eagle_mlp: the head's directory
    (config.json and eagle_mlp.safetensors)."""
    draft_load_format: str = "auto"
    """draft_model: how to load the draft (auto, hf, gguf, dummy), like --load-format."""
    draft_num_layers: int | None = None
    """draft_model: keep only the draft's first N decoder layers (a layer-truncated copy;
    the final norm and lm_head are kept). None: all of them."""
    draft_quantization: str | None = None
    """draft_model: the draft's weight storage, like --quantization (auto, none, int8, int4,
    gguf). None: none when the target runs dense (--quantization none), else auto. A
    quantized copy of the target is a cheap, well-matched draft."""
    medusa_tree: str | int | tuple | None = None
    """medusa: the candidate tree verified in one step with tree attention. None: the
    best tree of the device's default size (4 nodes on CPU, 32 on a GPU) for the heads'
    measured accuracies; an int N: the best N-node tree; a list of choices (rank paths,
    e.g. [[0], [1], [0, 0]]); "chain": each head's top-1 guess as one chain, verified by
    exact rejection sampling."""
    tree_acceptance: str = "exact"
    """medusa tree, temperature > 0: "exact" (the target samples a token at each node
    of the path from its own distribution, and the path goes on while a child of the node
    holds that token: the output is exactly the target's distribution) or "typical" (the
    Medusa paper's typical acceptance: keeps every candidate the target finds plausible,
    more tokens per step at high temperature, but not the target's distribution)."""
    posterior_threshold: float = 0.09
    """medusa tree, temperature > 0, tree_acceptance "typical": a candidate is kept when
    the target gives it probability above min(posterior_threshold, posterior_alpha *
    exp(-entropy))."""
    posterior_alpha: float = 0.3
    """medusa tree, temperature > 0: see posterior_threshold."""
    draft_confidence: float = 0.0
    """eagle_mlp: a request's drafts stop at the first one the head gives a probability
    below this (softmax over its draft vocabulary); with none left the request takes a
    plain decode step. Where each verified row costs nearly as much as a decode step
    (CPU), drafting only sure tokens keeps speculation from losing. 0: always k."""

    def __post_init__(self) -> None:
        require(self.method in SPEC_METHODS, "speculative_config.method",
                f"must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")
        require(isinstance(self.num_speculative_tokens, int)
                and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
                "speculative_config.num_speculative_tokens",
                f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.num_speculative_tokens!r}")
        require(isinstance(self.prompt_lookup_min, int) and self.prompt_lookup_min >= 1,
                "speculative_config.prompt_lookup_min",
                f"must be an integer >= 1, got {self.prompt_lookup_min!r}")
        require(isinstance(self.prompt_lookup_max, int)
                and self.prompt_lookup_min <= self.prompt_lookup_max <= 64,
                "speculative_config.prompt_lookup_max",
                f"must be an integer in [prompt_lookup_min ({self.prompt_lookup_min}), 64], "
                f"got {self.prompt_lookup_max!r}")
        if self.disable_by_batch_size is not None:
            require(isinstance(self.disable_by_batch_size, int)
                    and self.disable_by_batch_size >= 1,
                    "speculative_config.disable_by_batch_size",
                    f"must be an integer >= 1 or null, got {self.disable_by_batch_size!r}")
        if self.method == "draft_model":
            require(self.model is not None or self.draft_num_layers is not None,
                    "speculative_config.model", "is needed for method draft_model (or give "
                    "draft_num_layers to draft with the target's own first layers)")
            require(self.model is None or (isinstance(self.model, str) and self.model),
                    "speculative_config.model", f"must be a model name or path, got "
                    f"{self.model!r}")
            require(self.draft_load_format in ("auto", "hf", "gguf", "dummy"),
                    "speculative_config.draft_load_format",
                    f"must be auto, hf, gguf or dummy, got {self.draft_load_format!r}")
            require(self.draft_quantization in (None, "auto", "none", "int8", "int4", "gguf"),
                    "speculative_config.draft_quantization",
                    f"must be auto, none, int8, int4 or gguf, got {self.draft_quantization!r}")
            if self.draft_num_layers is not None:
                require(isinstance(self.draft_num_layers, int) and self.draft_num_layers >= 1,
                        "speculative_config.draft_num_layers",
                        f"must be an integer >= 1, got {self.draft_num_layers!r}")
        elif self.method == "medusa":
            require(isinstance(self.model, str) and bool(self.model),
                    "speculative_config.model", "is needed for method medusa: the directory "
                    "of the heads (config.json and medusa_lm_head.safetensors)")
            for name in ("draft_num_layers", "draft_quantization"):
                require(getattr(self, name) is None, f"speculative_config.{name}",
                        "is an option of method draft_model, not medusa")
            tree = self.medusa_tree
            require(tree is None or tree == "chain"
                    or (isinstance(tree, int) and not isinstance(tree, bool))
                    or isinstance(tree, (list, tuple)), "speculative_config.medusa_tree",
                    f"must be null, \"chain\", a node count or a list of choices, got {tree!r}")
            if isinstance(tree, (list, tuple)):  # frozen and hashable: tuples of tuples
                from kvflow.spec_decode.tree import DraftTree

                object.__setattr__(self, "medusa_tree", DraftTree.from_choices(tree).choices)
            require(self.tree_acceptance in ("exact", "typical"),
                    "speculative_config.tree_acceptance",
                    f"must be exact or typical, got {self.tree_acceptance!r}")
            for name in ("posterior_threshold", "posterior_alpha"):
                v = getattr(self, name)
                require(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1,
                        f"speculative_config.{name}", f"must be a number in [0, 1], got {v!r}")
        elif self.method == "eagle_mlp":
            require(isinstance(self.model, str) and bool(self.model),
                    "speculative_config.model", "is needed for method eagle_mlp: the "
                    "directory of the head (config.json and eagle_mlp.safetensors)")
            v = self.draft_confidence
            require(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1,
                    "speculative_config.draft_confidence",
                    f"must be a number in [0, 1), got {v!r}")
            for name in ("draft_num_layers", "draft_quantization"):
                require(getattr(self, name) is None, f"speculative_config.{name}",
                        "is an option of method draft_model, not eagle_mlp")
        else:
            for name in ("model", "draft_num_layers", "draft_quantization"):
                require(getattr(self, name) is None, f"speculative_config.{name}",
                        f"is an option of method draft_model, not {self.method}")
        if self.method != "medusa":
            require(self.medusa_tree is None, "speculative_config.medusa_tree",
                    f"is an option of method medusa, not {self.method}")
        if self.method != "eagle_mlp":
            require(self.draft_confidence == 0.0, "speculative_config.draft_confidence",
                    f"is an option of method eagle_mlp, not {self.method}")

    @classmethod
    def from_dict(cls, values: dict) -> "SpeculativeConfig":
        """Build from user JSON, naming any unknown or missing option."""
        if not isinstance(values, dict):
            raise InvalidParameterError("speculative_config must be a JSON object, got "
                                        f"{type(values).__name__}",
                                        param="speculative_config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        require(not unknown, "speculative_config",
                f"has unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        for name in ("method", "num_speculative_tokens"):
            require(name in values, "speculative_config", f"needs {name!r}")
        return cls(**values)


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over processes (one process per rank, torch.distributed).

    Ranks are numbered node by node; inside a stage the tensor-parallel ranks are
    consecutive (TP inside a node, PP across nodes). Rank 0 runs beside the scheduler.
    """

    tensor_parallel_size: int = 1
    """Ranks that split every layer Megatron-style (heads, MLP columns, vocabulary)."""
    pipeline_parallel_size: int = 1
    """Stages that each hold a contiguous range of layers."""
    nnodes: int = 1
    """Machines the ranks are spread over (each runs world_size / nnodes ranks)."""
    node_rank: int = 0
    """This machine's index; node 0 runs the scheduler and serves HTTP."""
    master_addr: str = "127.0.0.1"
    """Address of node 0, where the rendezvous store listens."""
    master_port: int | None = None
    """Port of the rendezvous store; None picks a free one (single node only)."""
    timeout_s: float = 60.0
    """A collective that waits longer than this fails (a dead or stuck rank)."""
    stage: int = 0
    """The pipeline stage of the process this config is for (the executor sets it per
    rank; it sizes that rank's KV cache to its layers)."""
    launcher: str = "kvflow"
    """Who starts the ranks: kvflow (each node's ``kvflow serve`` starts its ranks) or
    torchrun (one process per rank, each told its rank by RANK and LOCAL_RANK)."""
    pipeline_in_flight: int | None = None
    """Scheduled batches in flight at once with pipeline parallelism (each its own
    requests, like vLLM's virtual engines), so that no stage idles; None: one per stage;
    1: one batch at a time (stages take turns)."""
    enable_expert_parallel: bool = False
    """MoE layers: each tensor-parallel rank holds num_experts / tp experts whole instead
    of a slice of every expert's intermediate dimension."""

    def __post_init__(self) -> None:
        require(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        require(self.pipeline_parallel_size >= 1, "pipeline_parallel_size", "must be >= 1")
        require(self.nnodes >= 1, "nnodes", "must be >= 1")
        require(0 <= self.node_rank < self.nnodes, "node_rank",
                 f"must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        require(self.world_size % self.nnodes == 0, "nnodes",
                 f"must divide the number of ranks (tensor x pipeline = {self.world_size})")
        require(self.nnodes == 1 or self.master_port is not None, "master_port",
                 "must be given when the ranks span several nodes")
        if self.master_port is not None:
            require(0 < self.master_port < 65536, "master_port", "must be a TCP port")
        require(self.timeout_s > 0, "timeout_s", "must be > 0 seconds")
        require(0 <= self.stage < self.pipeline_parallel_size, "stage",
                 f"must be in [0, pipeline_parallel_size={self.pipeline_parallel_size})")
        require(self.launcher in ("kvflow", "torchrun"), "launcher",
                f"must be kvflow or torchrun, got {self.launcher!r}")
        require(self.pipeline_in_flight is None or self.pipeline_in_flight >= 1,
                "pipeline_in_flight", "must be >= 1")

    @property
    def batches_in_flight(self) -> int:
        """How many scheduled batches the engine keeps in flight (1 without pipeline
        parallelism: overlapped steps are async_scheduling's business)."""
        if self.pipeline_parallel_size == 1:
            return 1
        return self.pipeline_in_flight or self.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def stage_layers(self, num_layers: int, stage: int | None = None) -> tuple[int, int]:
        """Layers [start, end) of a pipeline stage (this config's by default): contiguous,
        the first ``num_layers % pp`` stages one layer longer."""
        pp = self.pipeline_parallel_size
        stage = self.stage if stage is None else stage
        base, extra = divmod(num_layers, pp)
        start = stage * base + min(stage, extra)
        return start, start + base + (1 if stage < extra else 0)

    def kv_heads_per_rank(self, num_kv_heads: int) -> int:
        """KV heads one TP rank holds: its share, or one replicated head when there are
        more ranks than KV heads."""
        return max(1, num_kv_heads // self.tensor_parallel_size)

    def check_model(self, arch: ModelArchConfig) -> None:
        """Refuse a split the model's shapes do not allow, saying what would work."""
        tp = self.tensor_parallel_size
        heads, kvh = arch.num_attention_heads, arch.num_key_value_heads
        sizes = [n for n in range(1, heads + 1) if heads % n == 0
                 and (kvh % n == 0 or n % kvh == 0) and arch.intermediate_size % n == 0]
        require(tp in sizes, "tensor_parallel_size",
                f"{tp} does not split this model ({heads} attention heads, {kvh} KV heads, "
                f"intermediate size {arch.intermediate_size}); possible sizes: {sizes}")
        require(self.pipeline_parallel_size <= arch.num_hidden_layers,
                "pipeline_parallel_size",
                f"must be at most the number of layers ({arch.num_hidden_layers})")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, in one object."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    speculative: SpeculativeConfig | None = None
    """Speculative decoding; None: off."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    draft_model: ModelConfig | None = None
    """The draft model of ``speculative`` method draft_model, resolved (EngineArgs makes
    it from speculative_config.model and checks its vocabulary); None otherwise."""
    pooler: PoolerConfig = field(default_factory=PoolerConfig)
    """How embeddings, rerank and score requests pool (``--runner``, ``--task``)."""
    lora: LoRAConfig | None = None
    """Multi-LoRA serving (kvflow/lora/, docs/lora.md); None: off."""

    def __post_init__(self) -> None:
        self.parallel.check_model(self.model.arch)
        # Speculation with async_scheduling: the engine collects every verification step
        # before it builds the next one (kvflow/engine/spec_overlap.py).
        # Overlapped steps feed a request's in-flight token into its next step; batches
        # in flight keep each request in one batch at a time instead.
        require(self.parallel.batches_in_flight == 1 or not self.scheduler.async_scheduling,
                "async_scheduling", "cannot be combined with several pipeline batches in "
                "flight (--pipeline-in-flight 1 for stage-by-stage steps with overlap)")
        # Verification samples on every rank today; with several ranks it would have to
        # sample once and broadcast its verdicts, which is not built yet.
        # Drafts and Medusa heads would have to run each row's adapter too.
        require(self.lora is None or self.speculative is None, "enable_lora",
                "cannot be combined with speculative decoding yet")
        require(self.speculative is None or self.parallel.world_size == 1,
                "speculative_config", "cannot be combined with tensor or pipeline "
                "parallelism yet (use one rank)")
        arch = self.model.arch
        require(self.speculative is None or self.speculative.method != "medusa" or not (
            arch.sliding_window or arch.attn_logit_softcapping or arch.rope_local_base_freq),
            "speculative_config.method", "medusa's candidate trees are not supported on "
            "windowed or soft-capped attention layers (use ngram or draft_model)")
        needs_draft = self.speculative is not None and self.speculative.method == "draft_model"
        require(needs_draft == (self.draft_model is not None), "speculative_config.model",
                "a draft model config goes with method draft_model and only with it")
        if self.draft_model is not None:
            require(self.draft_model.arch.vocab_size == self.model.arch.vocab_size,
                    "speculative_config.model",
                    f"{self.draft_model.model!r} has a vocabulary of "
                    f"{self.draft_model.arch.vocab_size} tokens but the target "
                    f"{self.model.model!r} has {self.model.arch.vocab_size}: the draft must "
                    "share the target's tokenizer")
