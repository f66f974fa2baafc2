"""What real kernels reach, as fractions of the roofline and fixed costs per layer.

The roofline (bytes / bandwidth, FLOPs / matmul rate) is a lower bound no engine meets.
``Efficiency`` holds the measured overheads the planner adds to predict what kvflow
actually does. Every default comes from an H200 measurement in ``benchmarks/results/``:

- ``gpu-profile-steps-h200.json``: per-kernel GPU times of Llama-3.1-8B bf16 engine steps
  (decode at batch 1 and 256 with ~1k context, one 8192-token prefill);
- ``kernels-h200.json``: kvflow's Triton kernels alone, at engine shapes;
- the engine's own start-up log on the H200 (memory figures).

Fractions are of the GPU's effective ceilings (for the H200, 4.2 TB/s and 790 TFLOP/s).
Other GPUs get the same fractions and fixed costs: nothing here was measured on them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.config import GiB
from kvflow.errors import InvalidParameterError


def _fraction(value: float, name: str) -> None:
    if not 0.0 < value <= 1.5:
        raise InvalidParameterError(f"{name} must be a fraction in (0, 1.5], got {value}",
                                    param=name)


@dataclass(frozen=True)
class Efficiency:
    """Measured overheads on top of the roofline (defaults: H200, Llama-3.1-8B, bf16)."""

    gemm_bandwidth: float = 0.92
    """Fraction of HBM bandwidth the linear layers reach when weight reads bind. Batch-1
    decode profile: the GEMMs (q/k/v, o, gate/up, down, lm_head, split-K reduce) read
    15.01 GB of weights in 3.90 ms = 3.85 TB/s = 0.916 of 4.2 TB/s."""
    gemm_flops: float = 0.98
    """Fraction of the matmul rate the linear layers reach when FLOPs bind. 8192-token
    prefill profile: 114.4 TFLOP of GEMMs in 147.0 ms = 778 TFLOP/s = 0.98 of 790."""
    gemm_knee: float = 2.0
    """How the two GEMM limits combine: t = (t_bytes^p + t_flops^p)^(1/p). p = inf would be
    the plain roofline max(); p = 2 is the usual smooth knee (not fitted). Near the knee
    both limits cost: the batch-256 decode GEMMs took 6.01 ms where max() says 4.96 ms
    and p = 2 says 6.31 ms."""
    attn_decode_bandwidth: float = 0.89
    """Fraction of HBM bandwidth the paged-attention kernel reaches reading the KV cache
    in decode: kernels-h200.json, decode B=256 ctx U[512,1024]: 0.887 (0.876-0.977 at
    longer contexts)."""
    attn_prefill_flops: float = 0.41
    """Fraction of the matmul rate the attention kernel reaches in prefill:
    kernels-h200.json, 1x8192 fresh prefill 326 TFLOP/s = 0.413 (0.41 for a 2048 chunk
    after 6144 cached; 0.27 for 4x1024)."""
    attn_layer_fixed_s: float = 12.5e-6
    """Fixed cost of attention per layer and step: batch-1 decode profile, paged attention
    (383 us) + split merge (52 us) over 32 layers = 13.6 us, less the 1.1 us its 4 MB of
    KV needs."""
    small_layer_fixed_s: float = 8.2e-6
    """Fixed cost per layer and step of the small kernels (2 RMSNorms, rotary + KV write,
    SiLU-and-mul): batch-1 decode profile, 139 + 82 + 44 us over 32 layers."""
    elementwise_bandwidth: float = 0.95
    """Fraction of HBM bandwidth those small kernels reach once they move real data:
    kernels-h200.json at 8192 tokens: SiLU 0.96, fused add+RMSNorm 0.90, rotary 0.87;
    the 8192-token prefill profile shows ~1.0."""
    step_fixed_s: float = 42e-6
    """Fixed cost per step outside the layers (argmax, input copies, embedding gather):
    batch-1 decode profile, 27.6 + 7.6 + 3.9 + 3.3 us."""
    eager_launch_s_per_layer: float = 0.54e-3
    """Host time to launch one layer's kernels in eager mode (prefill and mixed steps run
    without CUDA graphs): the batch-1 eager decode step spans 17.39 ms on the GPU timeline
    for 4.65 ms of kernels, i.e. it is host-bound at 17.39 / 32 layers. Decode-only steps
    replay CUDA graphs and overlap host work (GPU-A idles 3 us per step)."""
    non_torch_bytes: int = int(0.54 * GiB)
    """Device memory used outside torch's allocator (CUDA context, cuBLAS workspaces): the
    engine's start-up log on the H200 showed 0.35 and 0.54 GiB; the larger is kept."""
    activation_bytes_per_token: tuple[int, int] = (4, 3)
    """Peak forward activations per token as (a, b) in elements of the model dtype:
    a * hidden + b * intermediate (residual, normed input, layer input and output, and the
    gate/up output with its SiLU product alive at once in the MLP). The H200 log: 1.84 GiB
    for a 16384-token step; this gives 1.81 GiB."""
    sampler_row_copies: float = 11.0
    """Live float32 [rows, vocab] tensors at the sampler's peak (the profiling step samples
    max_num_seqs rows with min-p, top-k, top-p and logprobs): counted in the sampler code
    (input, scaled, min-p softmax and mask, sort values and int64 indices, top-p softmax,
    cumsum and mask, scatter) ~ 10-11; the H200 log (1.38 GiB at 256 rows) implies 11.3."""

    def __post_init__(self) -> None:
        for name in ("gemm_bandwidth", "gemm_flops", "attn_decode_bandwidth",
                     "attn_prefill_flops", "elementwise_bandwidth"):
            _fraction(getattr(self, name), name)
        if self.gemm_knee < 1.0:
            raise InvalidParameterError(f"gemm_knee must be >= 1, got {self.gemm_knee}",
                                        param="gemm_knee")
        for name in ("attn_layer_fixed_s", "small_layer_fixed_s", "step_fixed_s",
                     "eager_launch_s_per_layer", "non_torch_bytes", "sampler_row_copies"):
            if getattr(self, name) < 0:
                raise InvalidParameterError(f"{name} must be >= 0", param=name)


H200_CALIBRATED = Efficiency()
