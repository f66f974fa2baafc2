"""Engine arguments: one definition for the CLI (``kvflow generate/serve/bench``) and the
Python API (``LLM(model, **engine_args)``). Each field's help text is its CLI help."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from dataclasses import dataclass, field

from kvflow.config import (CacheConfig, DeviceConfig, EngineConfig, ModelConfig,
                           ParallelConfig, SchedulerConfig, SpeculativeConfig)
from kvflow.core.repetition import DEFAULT_GUARD
from kvflow.errors import InvalidParameterError
from kvflow.models.registry import DEFAULT_MODEL, load_generation_config, resolve_model
from kvflow.sampling_params import MAX_REPETITION_GUARD, SamplingParams

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20,
          "mb": 10**6, "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30,
          "t": 1 << 40, "tib": 1 << 40}


def parse_bytes(value: str | int | float | None, param: str = "size") -> int | None:
    """A size: an int is bytes; a string like '4GiB', '512MiB', '4g' or a bare number
    (GiB, as is a float) is converted."""
    if value is None or isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float):
        return int(value * (1 << 30))
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidParameterError(f"{param} must be a size like 4GiB or 512MiB, "
                                    f"got {value!r}", param=param)
    number, unit = float(m.group(1)), m.group(2).lower()
    return int(number * (_UNITS[unit] if unit else 1 << 30))


def _arg(default, help: str, **extra):
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class EngineArgs:
    model: str = _arg(DEFAULT_MODEL, "model: a preset name (smollm2-135m is embedded), a "
                      "local Hugging Face directory, or a GGUF file", positional=True)
    tokenizer: str | None = _arg(None, "tokenizer path (default: the model's own)")
    load_format: str = _arg("auto", "auto, hf (safetensors), gguf, or dummy (random weights "
                            "for an architecture preset)",
                            choices=["auto", "hf", "gguf", "dummy"])
    dtype: str = _arg("auto", "weights and activations dtype; auto = bfloat16 on GPU, "
                      "float32 on CPU", choices=["auto", "float32", "bfloat16", "float16"])
    quantization: str = _arg("auto", "weight storage: auto (GGUF files keep their quantized "
                             "blocks on CPU, other checkpoints stay dense), none (dense in "
                             "--dtype), int8 (per channel) or int4 (group-wise) quantized "
                             "at load, gguf, fp8 (W8A8: FP8 weights per channel and "
                             "activations per token; emulated on CPU), fp8-block "
                             "(DeepSeek-style 128x128 weight blocks, 1x128 activation "
                             "groups), w8a8-int8 (int8 weights per "
                             "channel and activations per token, torch._int_mm; SmoothQuant "
                             "checkpoints of `kvflow quantize` load with auto), llm-int8 "
                             "(int8 with the outlier columns in the model dtype)",
                             choices=["auto", "none", "int8", "int4", "gguf", "fp8",
                                      "fp8-block", "w8a8-int8", "llm-int8"])
    quantization_group_size: int = _arg(32, "int4: input elements per scale (32, 64, 128)",
                                        choices=[32, 64, 128])
    quantization_symmetric: bool = _arg(False, "int4: symmetric (scale only) instead of a "
                                        "zero point per group")
    llm_int8_threshold: float = _arg(6.0, "llm-int8: activation columns whose absolute "
                                     "maximum in a step exceeds this run in the model dtype")
    lm_head_quantization: str = _arg("auto", "lm_head of a model quantized at load: auto "
                                     "(int8 for int8/int4, the model dtype for fp8, "
                                     "fp8-block, w8a8-int8, llm-int8), none (model dtype) "
                                     "or int8 (per output channel, weight-only: at batch 1 "
                                     "on 8B about 0.1 ms less per token than bf16)",
                                     choices=["auto", "none", "int8"])
    device: str = _arg("auto", "cpu, cuda or cuda:N; auto picks cuda when available")
    max_model_len: int | None = _arg(None, "longest prompt + output per request (default: "
                                     "the model's context length)")
    seed: int = _arg(0, "seed for dummy weights and for requests without their own seed")
    served_model_name: str | None = _arg(None, "model name reported by the API")
    generation_config: str = _arg("auto", "sampling defaults for fields a request leaves "
                                  "out: auto (the model's generation_config.json, GGUF "
                                  "metadata, or kvflow's registry entry for an embedded "
                                  "model), none (temperature 1, no filters), or the path "
                                  "of a generation_config.json (or its folder)")
    max_tokens_default: int | None = _arg(None, "output tokens for requests that leave "
                                          "max_tokens out; 0: up to max_model_len "
                                          "(default: kvflow's registry entry for a file it "
                                          "knows, 1024 for the embedded model, else 0)")
    repetition_guard: int | None = _arg(None, "end a request whose output ends in one "
                                        "block of tokens repeated 3 times over at least "
                                        "this many tokens (stop_reason 'repetition'); 0: "
                                        "off (default: 64, off with dummy weights); a "
                                        "request's repetition_guard wins")
    chat_template: str | None = _arg(None, "chat template replacing the model's: a file "
                                     "path or the Jinja text itself (as vLLM takes it)")
    skip_tokenizer_init: bool = _arg(False, "run without a tokenizer (token ids in and out)")
    block_size: int = _arg(16, "tokens per KV cache block")
    gpu_memory_utilization: float = _arg(0.9, "fraction of GPU memory for weights, "
                                         "activations and KV cache")
    kv_cache_memory: str | None = _arg(None, "KV cache size, e.g. 4GiB (CPU default 4GiB; "
                                       "on GPU overrides profiling)")
    num_gpu_blocks_override: int | None = _arg(None, "use exactly this many KV blocks")
    kv_cache_dtype: str = _arg("auto", "KV cache storage: auto (= --dtype), int8 (per-token "
                               "and head scales) or fp8 (E4M3, per-tensor scales); int8 and "
                               "fp8 hold twice the tokens of a bf16 cache, 4x fp32",
                               choices=["auto", "int8", "fp8"])
    enable_prefix_caching: bool = _arg(True, "reuse KV blocks of shared prompt prefixes")
    preemption_mode: str = _arg("recompute", "when blocks run out: recompute the preempted "
                                "request later, swap its KV to host memory, or auto (per "
                                "request, the cheaper)", choices=["recompute", "swap", "auto"])
    kv_layout: str = _arg("paged", "paged KV blocks, or contiguous: each request reserves "
                          "max_model_len of KV at admission (an ablation baseline; needs "
                          "--no-enable-prefix-caching)", choices=["paged", "contiguous"])
    swap_space: str = _arg("4GiB", "host memory for swapped-out KV (swap/auto modes)")
    max_num_batched_tokens: int | None = _arg(None, "token budget per step (default 8192 "
                                              "on GPU, 2048 on CPU; kvflow serve on CPU "
                                              "also sizes it by --target-step-ms)")
    max_num_seqs: int | None = _arg(None, "most requests running at once (default 256 on "
                                    "GPU, 128 on CPU)")
    enable_chunked_prefill: bool = _arg(True, "split long prompts across steps")
    batching: str = _arg("continuous", "continuous batching, or static: a batch forms only "
                         "when the previous one has finished (an ablation baseline)",
                         choices=["continuous", "static"])
    max_queued_requests: int | None = _arg(None, "refuse requests beyond this many waiting")
    target_tpot_ms: float | None = _arg(None, "latency target in ms per output token: "
                                        "each step's token budget and running batch are "
                                        "capped so its predicted time stays under it; "
                                        "requests beyond that wait (see "
                                        "--max-queued-requests); 0: off (the default)")
    target_ttft_ms: float | None = _arg(None, "with --target-tpot-ms: a waiting request "
                                        "that would miss this time to first token (and "
                                        "can still make it) is admitted with the prefill "
                                        "chunk it needs, even over the TPOT plan")
    target_step_ms: float | None = _arg(None, "smooth steps: each step's token budget is "
                                        "sized so its predicted time stays under this "
                                        "many ms (prompt chunks shrink, at least 32 "
                                        "tokens; running streams always decode); 0: off. "
                                        "Default: 100 for kvflow serve on CPU, off "
                                        "otherwise (docs/serving.md)")
    max_seqs_per_request: int | None = _arg(None, "most sequences one request's n samples "
                                            "run at once, so a large n leaves seats to "
                                            "others (default: --max-num-seqs / 8, at "
                                            "least 16)")
    enforce_eager: bool = _arg(False, "never use CUDA graphs")
    deterministic: bool = _arg(False, "batch-invariant GPU kernels: a request's tokens and "
                               "logprobs do not depend on what else shares its steps, at "
                               "a throughput cost (docs/determinism.md; on CPU this holds "
                               "without the flag)",
                               aliases=["--enable-deterministic-inference"])
    cpu_step_threads: str = _arg("adaptive", "CPU: adaptive (each size class of step runs "
                                 "on one torch thread or all of them, whichever measures "
                                 "faster) or all", choices=["adaptive", "all"])
    async_scheduling: bool | None = _arg(None, "prepare and launch step N+1 while step N runs "
                                         "(default: on for GPU, off for CPU)")
    speculative_config: str | dict | None = _arg(
        None, "speculative decoding as JSON, e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' (see "
        "docs/speculative.md)")
    enable_lora: bool = _arg(False, "serve PEFT LoRA adapters per request (docs/lora.md)")
    lora_modules: list[str] | None = _arg(None, "adapters served from the start: name=path "
                                          "... (each listed in /v1/models)", nargs="+")
    max_loras: int = _arg(4, "LoRA: adapters one step can hold (device slots)")
    max_cpu_loras: int | None = _arg(None, "LoRA: adapters kept in host memory (default: "
                                     "--max-loras)")
    max_lora_rank: int = _arg(16, "LoRA: the largest adapter rank (slots are this size)")
    allow_runtime_lora_updating: bool = _arg(False, "serve /v1/load_lora_adapter and "
                                             "/v1/unload_lora_adapter")
    tensor_parallel_size: int = _arg(1, "split every layer over this many ranks (Megatron "
                                     "tensor parallelism; one process per rank)",
                                     aliases=["-tp"])
    enable_expert_parallel: bool = _arg(False, "MoE models: shard the experts whole over "
                                        "the tensor-parallel ranks (expert parallelism) "
                                        "instead of slicing every expert")
    pipeline_parallel_size: int = _arg(1, "split the layers into this many stages",
                                       aliases=["-pp"])
    pipeline_in_flight: int | None = _arg(None, "scheduled batches in flight at once with "
                                          "pipeline parallelism (default: one per stage; "
                                          "1: one at a time)")
    nnodes: int = _arg(1, "machines the ranks span (each runs tp x pp / nnodes ranks)")
    node_rank: int = _arg(0, "this machine's index; node 0 runs the scheduler and serves")
    master_addr: str = _arg("127.0.0.1", "address of node 0 (rendezvous of the ranks)")
    master_port: int | None = _arg(None, "rendezvous port on node 0 (default: a free one; "
                                   "required with --nnodes > 1)")
    runner: str = _arg("auto", "generate (text; also answers embeddings and scores) or "
                       "pooling (embeddings, rerank and score only); auto: pooling for a "
                       "sentence-transformers folder or a reranker, else generate",
                       choices=["auto", "generate", "pooling"])
    task: str | None = _arg(None, "embed or score: a pooling runner for embeddings, or a "
                            "cross-encoder reranker read from its yes/no logits "
                            "(docs/embeddings.md)", choices=["embed", "score"])
    pooling_type: str = _arg("auto", "how embeddings pool the prompt's hidden states: "
                             "last token, mean, or cls (first token); auto: the "
                             "checkpoint's sentence-transformers config, else last",
                             choices=["auto", "last", "mean", "cls"])
    distributed_timeout: float = _arg(60.0, "seconds a collective may wait for a rank "
                                      "before the engine stops with an error")

    # --- CLI --------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser,
                     model_positional: bool = True) -> argparse.ArgumentParser:
        for f in dataclasses.fields(cls):
            meta = f.metadata
            flag = "--" + f.name.replace("_", "-")
            kwargs = {"help": meta["help"], "default": f.default}
            if f.name == "model" and model_positional:
                parser.add_argument("model", nargs="?", default=f.default, help=meta["help"])
                parser.add_argument("--model", dest="model_flag", default=None,
                                    help=argparse.SUPPRESS)
                continue
            if "bool" in str(f.type):
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = _cli_type(f.type)
                if "choices" in meta:
                    kwargs["choices"] = meta["choices"]
                if "nargs" in meta:
                    kwargs["nargs"] = meta["nargs"]
            parser.add_argument(flag, *meta.get("aliases", []), **kwargs)
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "EngineArgs":
        values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)
                  if hasattr(ns, f.name)}
        if getattr(ns, "model_flag", None):
            values["model"] = ns.model_flag
        return cls(**values)

    # --- resolution -----------------------------------------------------------------
    def create_engine_config(self) -> EngineConfig:
        """Resolve 'auto' values against the machine and the model, then validate."""
        device = self._resolve_device()
        on_gpu = device.startswith("cuda")
        resolved = resolve_model(self.model, self.load_format)
        dtype = self.dtype if self.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
        max_len = (resolved.arch.max_position_embeddings if self.max_model_len is None
                   else self.max_model_len)
        if max_len < 1:
            raise InvalidParameterError("max_model_len must be >= 1", param="max_model_len")
        tokenizer = None if self.skip_tokenizer_init else (self.tokenizer or resolved.tokenizer)
        gen_defaults, gen_source = self._generation_defaults(resolved)
        model = ModelConfig(
            model=self.model, path=resolved.path, load_format=resolved.load_format,
            arch=resolved.arch, dtype=dtype, max_model_len=max_len, tokenizer=tokenizer,
            served_model_name=self.served_model_name or self.model, seed=self.seed,
            generation_defaults=tuple(sorted(gen_defaults.items())),
            generation_source=gen_source, **self._length_defaults(resolved),
            chat_template=read_chat_template(self.chat_template),
            quantization=self.quantization,
            quantization_group_size=self.quantization_group_size,
            quantization_symmetric=self.quantization_symmetric,
            llm_int8_threshold=self.llm_int8_threshold,
            lm_head_quantization=self.lm_head_quantization,
            dtype_forced=self.dtype != "auto")
        cache = CacheConfig(
            block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory=parse_bytes(self.kv_cache_memory, "kv_cache_memory"),
            num_blocks_override=self.num_gpu_blocks_override,
            enable_prefix_caching=self.enable_prefix_caching,
            preemption_mode=self.preemption_mode,
            swap_space=parse_bytes(self.swap_space, "swap_space"), kv_layout=self.kv_layout,
            cache_dtype=self.kv_cache_dtype)
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = 8192 if on_gpu else 2048
        if not self.enable_chunked_prefill:
            batched = max(batched, max_len)
        speculative = parse_speculative_config(self.speculative_config)
        async_scheduling = on_gpu if self.async_scheduling is None else self.async_scheduling
        # Speculation keeps overlapped steps: a step that verifies drafts, or whose drafts
        # the next step verifies, is collected before the next is scheduled; the others
        # overlap as in plain decoding (kvflow/engine/spec_overlap.py).
        if self.pipeline_parallel_size > 1 and self.pipeline_in_flight != 1 \
                and async_scheduling:
            # Batches in flight overlap the stages; a request is in one batch at a time,
            # so overlapping a request's consecutive steps does not apply.
            if self.async_scheduling:
                raise InvalidParameterError(
                    "async_scheduling cannot be combined with several pipeline batches in "
                    "flight; drop --async-scheduling or add --pipeline-in-flight 1",
                    param="async_scheduling")
            async_scheduling = False
        scheduler = SchedulerConfig(
            max_num_batched_tokens=batched,
            max_num_seqs=(256 if on_gpu else 128) if self.max_num_seqs is None
            else self.max_num_seqs,
            max_model_len=max_len, enable_chunked_prefill=self.enable_chunked_prefill,
            max_queued_requests=self.max_queued_requests,
            target_tpot_ms=self.target_tpot_ms or None, target_ttft_ms=self.target_ttft_ms,
            target_step_ms=self.target_step_ms or None,
            max_seqs_per_request=self.max_seqs_per_request,
            batching=self.batching,
            async_scheduling=async_scheduling)
        parallel = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            enable_expert_parallel=self.enable_expert_parallel,
            timeout_s=self.distributed_timeout, pipeline_in_flight=self.pipeline_in_flight,
            **self._placement())
        draft = None
        if speculative is not None and speculative.method == "draft_model":
            from kvflow.spec_decode.draft_config import resolve_draft_model

            draft = resolve_draft_model(speculative, model)
        if speculative is not None and speculative.method == "medusa":
            from kvflow.spec_decode.heads_config import MedusaHeadsConfig

            from kvflow.spec_decode.tree import parse_tree_option

            heads = MedusaHeadsConfig.read(speculative.model)
            heads.check(resolved.arch.hidden_size, resolved.arch.vocab_size,
                        speculative.num_speculative_tokens)
            # A tree deeper than the heads, or too big, fails here (before any load).
            parse_tree_option(speculative.medusa_tree, heads.num_heads,
                              "cuda" if device.startswith("cuda") else "cpu", None,
                              speculative.num_speculative_tokens)
        if speculative is not None and speculative.method == "eagle_mlp":
            from kvflow.spec_decode.heads_config import EagleMlpConfig

            EagleMlpConfig.read(speculative.model).check(resolved.arch.hidden_size,
                                                         resolved.arch.vocab_size)
        from kvflow.pooling.config import resolve_pooler_config

        pooler = resolve_pooler_config(self.model, resolved.path, self.runner, self.task,
                                       self.pooling_type)
        lora = None
        if self.enable_lora or self.lora_modules:
            from kvflow.lora.config import LoRAConfig, parse_lora_modules

            lora = LoRAConfig(max_loras=self.max_loras, max_cpu_loras=self.max_cpu_loras,
                              max_lora_rank=self.max_lora_rank,
                              lora_modules=parse_lora_modules(self.lora_modules),
                              allow_runtime_updating=self.allow_runtime_lora_updating)
        return EngineConfig(model=model, cache=cache, scheduler=scheduler, lora=lora,
                            device=DeviceConfig(device=device,
                                                enforce_eager=self.enforce_eager,
                                                cpu_step_threads=self.cpu_step_threads,
                                                deterministic=self.deterministic),
                            speculative=speculative, parallel=parallel, draft_model=draft,
                            pooler=pooler)

    def _placement(self) -> dict:
        """Nodes, this node and the rendezvous: the flags, or torchrun's environment
        variables when torchrun started this process (a flag given as well must agree)."""
        from kvflow.distributed.torchrun import torchrun_rank

        flags = dict(nnodes=self.nnodes, node_rank=self.node_rank,
                     master_addr=self.master_addr, master_port=self.master_port)
        tr = torchrun_rank()
        if tr is None:
            return flags
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        if tr.world_size != world:
            raise InvalidParameterError(
                f"torchrun started WORLD_SIZE={tr.world_size} processes but "
                f"--tensor-parallel-size {self.tensor_parallel_size} x "
                f"--pipeline-parallel-size {self.pipeline_parallel_size} needs {world}",
                param="tensor_parallel_size")
        env = dict(nnodes=tr.nnodes, node_rank=tr.node_rank, master_addr=tr.master_addr,
                   master_port=tr.master_port)
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name in flags}
        for name, value in flags.items():
            if value != defaults[name] and value != env[name]:
                raise InvalidParameterError(
                    f"--{name.replace('_', '-')} {value} disagrees with torchrun's "
                    f"environment ({env[name]}); give one or the other", param=name)
        return dict(env, launcher="torchrun")

    def _length_defaults(self, resolved) -> dict:
        """max_tokens_default (flag, else the registry's for a known file) and the
        repetition guard (flag, else on for real weights: dummy weights loop by nature
        and their benches want every request to its full length)."""
        cap, source = self.max_tokens_default, "--max-tokens-default"
        if cap is None and self.generation_config == "auto":
            cap, source = resolved.max_tokens_default, resolved.generation_source
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int)
                                or cap < 0):
            raise InvalidParameterError("max_tokens_default must be an integer >= 0",
                                        param="max_tokens_default")
        guard = self.repetition_guard
        if guard is None:
            guard = 0 if resolved.load_format == "dummy" else DEFAULT_GUARD
        if isinstance(guard, bool) or not isinstance(guard, int) \
                or not 0 <= guard <= MAX_REPETITION_GUARD:
            raise InvalidParameterError(f"repetition_guard must be an integer in [0, "
                                        f"{MAX_REPETITION_GUARD}]", param="repetition_guard")
        return dict(max_tokens_default=cap or None,
                    max_tokens_source=source if cap else "none", repetition_guard=guard)

    def _generation_defaults(self, resolved) -> tuple[dict, str]:
        choice = self.generation_config
        if not isinstance(choice, str) or not choice:
            raise InvalidParameterError("generation_config must be auto, none or a path",
                                        param="generation_config")
        if choice == "none":
            return {}, "none"
        if choice == "auto":
            defaults, source = resolved.generation_defaults, resolved.generation_source
        else:
            defaults, source = load_generation_config(choice)
        try:  # a bad value is the model's or the operator's: say so at start, not per request
            SamplingParams(**defaults)
        except InvalidParameterError as e:
            raise InvalidParameterError(f"generation defaults from {source}: {e}",
                                        param="generation_config") from None
        return defaults, source

    def _resolve_device(self) -> str:
        if self.device != "auto":
            if self.device.startswith("cuda"):
                import torch

                if not torch.cuda.is_available():
                    raise InvalidParameterError("device cuda was asked for but no CUDA GPU "
                                                "is available", param="device")
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: the text of the file it names, or the Jinja template itself."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise InvalidParameterError("chat_template must be a file path or a Jinja template",
                                    param="chat_template")
    if "{" not in value and "\n" not in value:  # a template has tags; a path has neither
        try:
            with open(os.path.expanduser(value), encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise InvalidParameterError(
                f"chat_template {value!r} is not a readable file ({e.strerror}) nor a Jinja "
                f"template", param="chat_template") from None
    return value


def parse_speculative_config(value: str | dict | SpeculativeConfig | None
                             ) -> SpeculativeConfig | None:
    """``--speculative-config`` JSON (or a dict from ``LLM(...)``) -> SpeculativeConfig."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidParameterError(f"speculative_config is not valid JSON ({e}); give "
                                        "e.g. '{\"method\": \"ngram\", "
                                        "\"num_speculative_tokens\": 4}'",
                                        param="speculative_config") from None
    return SpeculativeConfig.from_dict(value)


def _cli_type(annotation):
    text = str(annotation)
    if "int" in text:
        return int
    if "float" in text:
        return float
    return str
