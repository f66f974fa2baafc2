"""Whether a request's outputs depend on what else shares its steps, and the
``system_fingerprint`` that names everything that can change them (docs/determinism.md).

Batch-invariant: every row of a step is computed in an order that does not depend on the
other rows, so a greedy or seeded request gives the same tokens and logprobs alone,
batched, chunked, cached or preempted. On CPU that is the C++ step's doing (it runs every
step of the models it can run); on the GPU it takes ``--deterministic``.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from kvflow import version
from kvflow.config import EngineConfig
from kvflow.errors import InvalidParameterError

INVARIANT = "batch-invariant"
VARIANT = "batch-variant"


@dataclass(frozen=True)
class Determinism:
    mode: str  # INVARIANT or VARIANT
    why: str
    fingerprint: str  # "fp_" + 12 hex digits

    def line(self) -> str:
        return f"outputs {self.mode} ({self.why}); system_fingerprint {self.fingerprint}"


def _cpu_mode(config: EngineConfig, runner) -> tuple[str, str]:
    from kvflow.cpu.step import CppDecodeStep

    graphs = getattr(runner, "graphs", None) if runner is not None else None
    if not isinstance(graphs, CppDecodeStep):
        return VARIANT, ("the eager CPU path (the log says why the C++ step is off), whose "
                         "GEMMs may sum a row differently by batch size")
    lora = getattr(runner, "lora", None)
    if config.lora is not None and not (lora is not None and lora.in_cpu_step):
        return VARIANT, "LoRA: steps with adapter rows run the eager CPU path"
    # (LoRA in the C++ step: a row's delta is summed in an order of its own, whatever
    # the rows and adapters beside it, cpu/step.cpp's add_lora.)
    # Every decoder linear on the int8-activation GEMV, whose row sums are a row's own
    # for any number of rows (prompt rows: the bf16 int4 GEMM, row-invariant too). Dense
    # float32 layers and the float32-activation GEMV take a GEMV up to 16 rows and a
    # GEMM above (oneDNN's sums of a row change below 8 rows too).
    if not (graphs.num_int8_act and graphs.num_int4 == 4 * graphs.num_layers
            and graphs.num_callbacks == graphs.num_int4):
        return VARIANT, ("the C++ CPU step with dense or float32-activation linears, "
                         "which take a GEMV up to 16 rows and a GEMM above")
    return INVARIANT, "the C++ CPU step runs every step, its linears on int8 activations"


def determine(config: EngineConfig, runner) -> Determinism:
    """The engine's mode (``runner``: rank 0's model runner in this process, or None when
    the ranks run elsewhere). ``--deterministic`` that cannot hold is an error."""
    dev = config.device
    if dev.is_cuda:
        mode, why = _gpu_mode(config, runner)
        if dev.deterministic and mode != INVARIANT:
            raise InvalidParameterError(
                f"--deterministic does not cover {why}, whose rows can still change with "
                f"the batch (docs/determinism.md); drop the flag or those features",
                param="deterministic")
    else:
        mode, why = _cpu_mode(config, runner)
        if dev.deterministic and mode != INVARIANT:
            raise InvalidParameterError(
                f"--deterministic: this engine's CPU steps run {why}, so outputs can "
                f"change with the batch; batch invariance on CPU needs the C++ step on "
                f"every step (one rank, a Llama-family model, a C++ compiler)",
                param="deterministic")
    return Determinism(mode, why, fingerprint(config, mode))


def _gpu_mode(config: EngineConfig, runner) -> tuple[str, str]:
    if not config.device.deterministic:
        return VARIANT, "GPU kernels chosen by batch size; --deterministic fixes them"
    if runner is None:  # the ranks run elsewhere: tensor or pipeline parallel
        return VARIANT, "several ranks (their all-reduce and stage hand-offs)"
    if not runner.deterministic:
        return VARIANT, "steps without the Triton kernels"
    gaps = list(runner.deterministic_gaps)
    if config.lora is not None:
        gaps.append("LoRA adapters")
    if config.speculative is not None:
        gaps.append("speculative decoding")
    if gaps:
        return VARIANT, "; ".join(gaps)
    return INVARIANT, "--deterministic: batch-invariant kernels"


def _model_identity(path: str | None) -> str:
    """The weights' path with their sizes and modification times: another file under
    the same name gives another fingerprint."""
    if not path or not os.path.exists(path):
        return str(path)
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, f) for f in os.listdir(path)
        if os.path.isfile(os.path.join(path, f)))
    parts = [path]
    for f in files:
        st = os.stat(f)
        parts.append(f"{os.path.basename(f)}:{st.st_size}:{int(st.st_mtime)}")
    return "|".join(parts)


def fingerprint(config: EngineConfig, mode: str) -> str:
    """``fp_`` and 12 hex digits of what can change a request's outputs: kvflow's
    version, the weights, their format and quantization, the dtypes, the KV cache's
    storage, the device kind, parallelism, speculation and the determinism mode."""
    m, c, p = config.model, config.cache, config.parallel
    device = config.device.device
    if config.device.is_cuda:
        try:
            import torch

            device = torch.cuda.get_device_name(config.device.device)
        except Exception:  # no driver in this process: the kind is still named
            pass
    fields = [
        version.__version__, _model_identity(m.path or m.model), m.load_format, str(m.seed)
        if m.load_format == "dummy" else "", m.dtype, str(m.quantization),
        str(m.quantization_group_size), str(m.quantization_symmetric),
        str(m.lm_head_quantization), c.cache_dtype, device,
        f"tp{p.tensor_parallel_size}pp{p.pipeline_parallel_size}",
        repr(config.speculative), mode,
    ]
    return "fp_" + hashlib.sha256("\x1f".join(fields).encode()).hexdigest()[:12]
