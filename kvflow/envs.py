"""Every environment variable kvflow reads, read here and nowhere else (rule 9 of
docs/architecture.md)."""

from __future__ import annotations

import contextlib
import os


def _choice(var: str, choices: tuple[str, ...]) -> str:
    """The lower-cased value of ``var`` (unset: ``choices[0]``), refused by name unless it
    is one of ``choices``."""
    mode = os.environ.get(var, choices[0]).lower()
    if mode not in choices:
        from kvflow.errors import InvalidParameterError

        allowed = ", ".join(choices[:-1]) + " or " + choices[-1]
        raise InvalidParameterError(f"{var} must be {allowed}, not {mode!r}")
    return mode


def log_level() -> str:
    """KVFLOW_LOG_LEVEL: DEBUG, INFO (default), WARNING or ERROR."""
    return os.environ.get("KVFLOW_LOG_LEVEL", "INFO").upper()


def models_dir() -> str | None:
    """KVFLOW_MODELS_DIR: an extra folder searched for models given by bare name."""
    return os.environ.get("KVFLOW_MODELS_DIR") or None


def disable_triton() -> bool:
    """KVFLOW_DISABLE_TRITON=1 makes the GPU path use the pure-torch references."""
    return os.environ.get("KVFLOW_DISABLE_TRITON", "0") == "1"


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: Triton runs its kernels in its interpreter on the CPU (the
    kernel tests set it); Triton itself reads it when a kernel is decorated, kvflow reads
    it to let CPU tensors take a Triton-only path (kvflow/kernels/fused_moe.py)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def gemv_mode() -> str:
    """KVFLOW_GEMV: which decode linears (M <= 8 rows, dense bf16/fp16 on CUDA) take the
    Triton GEMV instead of cuBLAS: ``auto`` (default: where the GPU's measured table in
    kvflow/kernels/tuning/ says it is faster), ``off`` (cuBLAS everywhere) or
    ``force`` (every shape, heuristic tiles; benchmarks and tests)."""
    return _choice("KVFLOW_GEMV", ("auto", "off", "force"))


def tuning_file() -> str | None:
    """KVFLOW_TUNING_FILE: measured tuning data overlaid on the GPU's own file in
    kvflow/kernels/tuning/ (comma-separated paths): files of that form, or the result
    files of benchmarks/gpu/bench_gemv.py, bench_woq_gemv.py or bench_fp8_gemv.py (their
    measured tables)."""
    return os.environ.get("KVFLOW_TUNING_FILE") or None


def rope_in_attention() -> str:
    """KVFLOW_ROPE_IN_ATTN: whether a decode-only step's rotary + KV-cache write runs inside
    the decode attention launch (kvflow/kernels/paged_attention.py, ``DecodeRope``)
    instead of as its own kernel: ``auto`` (default: where
    this GPU's tuning data in kvflow/kernels/tuning/ measured it faster), ``on`` or ``off``."""
    return _choice("KVFLOW_ROPE_IN_ATTN", ("auto", "on", "off"))


def prefill_graphs() -> str:
    """KVFLOW_PREFILL_GRAPHS: whether a step with one request of at most 512 new tokens (a
    short prompt on an idle engine: its TTFT) replays a CUDA graph captured at startup
    instead of launching its kernels eagerly (kvflow/worker/cuda_graphs.py): ``auto``
    (default: where this GPU's tuning data in kvflow/kernels/tuning/ measured it faster), ``on`` or
    ``off``."""
    return _choice("KVFLOW_PREFILL_GRAPHS", ("auto", "on", "off"))


def greedy_argmax_mode() -> str:
    """KVFLOW_GREEDY_ARGMAX: the sampler's greedy argmax on CUDA: ``auto`` (default: the
    split-row Triton kernel, kvflow/kernels/argmax.py, for vocabularies >= 8192) or
    ``torch`` (torch.argmax, one thread block per row)."""
    return _choice("KVFLOW_GREEDY_ARGMAX", ("auto", "torch"))


def woq_gemv_mode() -> str:
    """KVFLOW_WOQ_GEMV: whether decode rows (M <= 8) of int4 / int8 weight-only and FP8
    layers on CUDA take the low-bit tensor-core GEMVs (kvflow/kernels/gemv_w4.py,
    gemv_w8.py): ``auto`` (default: the GPU's table in kvflow/kernels/tuning/, heuristic
    tiles for shapes it lacks), ``off`` (the previous kernels: the register GEMV /
    w8a16 tiles, and W8A8 ``_scaled_mm`` for FP8) or ``force`` (every M <= 8)."""
    return _choice("KVFLOW_WOQ_GEMV", ("auto", "off", "force"))


def fp8_decode_mode() -> str:
    """KVFLOW_FP8_DECODE: how decode rows (M <= 8) of FP8 layers on CUDA multiply:
    ``auto`` (default: W8A8 on the FP8 tensor cores, kvflow/kernels/gemv_fp8.py, where the
    GPU's table in kvflow/kernels/tuning/ measured it faster, else the weight-dequant GEMV),
    ``w8a8`` (the FP8 x FP8 GEMV at every M <= 8, heuristic tiles where the table has
    none) or ``dequant`` (bf16 activations times the FP8 weights widened: the path before
    the W8A8 GEMV existed)."""
    return _choice("KVFLOW_FP8_DECODE", ("auto", "w8a8", "dequant"))


def no_progress_bar() -> bool:
    """KVFLOW_NO_PROGRESS=1 hides tqdm progress bars (logs and CI)."""
    return os.environ.get("KVFLOW_NO_PROGRESS", "0") == "1"


def cpu_threads() -> int | None:
    """KVFLOW_CPU_THREADS: torch threads of the server's engine-core process on CPU
    (default: all cores; all but one, left to the API process, from 8 cores up)."""
    value = os.environ.get("KVFLOW_CPU_THREADS")
    return int(value) if value else None


def cpu_compile() -> bool:
    """KVFLOW_CPU_COMPILE=1 turns on the compiled CPU decode step (off by default: it adds
    a compile to every engine start and no speed-up over eager is measured yet;
    --enforce-eager always keeps it off)."""
    return os.environ.get("KVFLOW_CPU_COMPILE", "0") == "1"


def cpu_kernels() -> bool:
    """KVFLOW_CPU_KERNELS=0 keeps kvflow's C++ CPU kernels (kvflow/cpu/kernels/) unused:
    the torch paths run instead (comparisons, debugging). On by default."""
    return os.environ.get("KVFLOW_CPU_KERNELS", "1") != "0"


def cxx() -> str | None:
    """CXX: the C++ compiler kvflow's CPU kernels are built with (default: c++ on PATH)."""
    return os.environ.get("CXX") or None


def torch_extensions_dir() -> str | None:
    """TORCH_EXTENSIONS_DIR: where torch (and kvflow's CPU kernels) keep built C++
    extensions (default: torch's ~/.cache/torch_extensions)."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or None


def cpu_cpp_step() -> bool:
    """KVFLOW_CPU_CPP_STEP=0 turns off the C++ CPU decode step (cpu/step.py; on by
    default where it applies; --enforce-eager always keeps it off)."""
    return os.environ.get("KVFLOW_CPU_CPP_STEP", "1") != "0"


def cpu_int4_gemv() -> bool:
    """KVFLOW_CPU_INT4_GEMV=0: the C++ CPU decode step calls GGUF 4-bit linears back into
    Python (the packed aten op on bfloat16) instead of its own float32 GEMV
    (cpu/int4.cpp), and GGUF layers keep no copy of their weights for it."""
    return os.environ.get("KVFLOW_CPU_INT4_GEMV", "1") != "0"


def cpu_int8_act() -> bool:
    """KVFLOW_CPU_INT8_ACT=0: the C++ CPU decode step's GGUF GEMV keeps float32
    activations instead of rounding them to int8 per block of 32 for integer dot products
    (cpu/int4.cpp ``q8_gemv``; used only where the build has its AVX512-VNNI or
    AVX2 kernel)."""
    return os.environ.get("KVFLOW_CPU_INT8_ACT", "1") != "0"


@contextlib.contextmanager
def float32_activations():
    """KVFLOW_CPU_INT8_ACT=0 while an engine is built inside (``kvflow bench
    --backend f32act-vs-int8act`` compares both GEMVs in one invocation)."""
    old = os.environ.get("KVFLOW_CPU_INT8_ACT")
    os.environ["KVFLOW_CPU_INT8_ACT"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("KVFLOW_CPU_INT8_ACT", None)
        else:
            os.environ["KVFLOW_CPU_INT8_ACT"] = old


def api_key() -> str | None:
    """KVFLOW_API_KEY: the server's API key when --api-key is not given."""
    return os.environ.get("KVFLOW_API_KEY") or None


def git_commit() -> str | None:
    """KVFLOW_GIT_COMMIT: the commit benchmark results record, for copies of the tree
    without git history (e.g. a GPU machine that receives the working tree)."""
    return os.environ.get("KVFLOW_GIT_COMMIT") or None


def fault_token() -> int | None:
    """KVFLOW_FAULT_TOKEN (tests only): a model step that schedules a request whose tokens
    contain this token id raises inside the worker, to test per-request fault isolation
    (kvflow.engine.faults)."""
    value = os.environ.get("KVFLOW_FAULT_TOKEN")
    return int(value) if value else None


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT")


def torchrun() -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and
    MASTER_PORT as torchrun sets them for each process it starts (those that are set);
    kvflow.distributed.torchrun reads them as the multi-node flags."""
    return {k: os.environ[k] for k in TORCHRUN_VARS if os.environ.get(k)}


def torchrun_agent_store() -> bool:
    """TORCHELASTIC_USE_AGENT_STORE=True: torchrun's agent hosts the rendezvous store at
    MASTER_ADDR:MASTER_PORT and every rank connects to it as a client."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def torchrun_restart_count() -> int:
    """TORCHELASTIC_RESTART_COUNT: how often torchrun restarted the ranks (keys of each
    attempt are kept apart in the agent's store)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
