"""GPU presets for the capacity planner, and custom GPUs given by hand.

Each figure says where it comes from. ``measured`` means measured on that GPU in this
repository (BENCHMARKS.md); ``derived`` means a datasheet figure scaled by the ratio the
H200 showed between its measured and its datasheet figure (HBM read 4.2 / 4.8 TB/s =
0.875, dense bf16 matmul 790 / 989 TFLOP/s = 0.80): a guess at what the card really
reaches, not a measurement. Memory is what torch reports as the card's total
(``torch.cuda.get_device_properties(0).total_memory``), a little less than the datasheet.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.config import GiB
from kvflow.errors import InvalidParameterError, require

# The H200's measured / datasheet ratios, used to derive the other cards' figures.
HBM_MEASURED_OVER_DATASHEET = 4.2 / 4.8
MATMUL_MEASURED_OVER_DATASHEET = 790 / 989


@dataclass(frozen=True)
class GpuSpec:
    """One GPU, as the planner sees it."""

    name: str
    """Display name, e.g. H200."""
    memory_bytes: int
    """Total device memory torch reports (what --gpu-memory-utilization is a fraction of)."""
    hbm_bytes_per_s: float
    """Effective HBM read bandwidth: the ceiling of the decode roofline."""
    matmul_flops_per_s: float
    """Effective dense matmul rate in bf16/fp16: the ceiling of the prefill roofline."""
    fp32_flops_per_s: float
    """Effective dense matmul rate in fp32 (torch's default, no TF32)."""
    link_bytes_per_s: float
    """GPU-to-GPU bandwidth per direction (NVLink or PCIe), for tensor-parallel
    all-reduces; a datasheet figure, never measured here."""
    link_latency_s: float
    """Fixed cost of one small all-reduce (launch and synchronisation); assumed."""
    source: str
    """Where the figures come from (measured, datasheet, derived)."""

    def __post_init__(self) -> None:
        require(self.memory_bytes > 0, "gpu memory", "must be > 0")
        require(self.hbm_bytes_per_s > 0, "gpu bandwidth", "must be > 0")
        require(self.matmul_flops_per_s > 0, "gpu tflops", "must be > 0")
        require(self.fp32_flops_per_s > 0, "gpu fp32 tflops", "must be > 0")
        require(self.link_bytes_per_s > 0, "gpu interconnect", "must be > 0")
        require(self.link_latency_s >= 0, "gpu link latency", "must be >= 0")

    def flops_per_s(self, dtype: str) -> float:
        """Matmul rate for weights of ``dtype`` (float32, bfloat16 or float16)."""
        return self.fp32_flops_per_s if dtype == "float32" else self.matmul_flops_per_s


def _gib(x: float) -> int:
    return int(x * GiB)


NVLINK4 = 450e9  # H100/H200 SXM: 900 GB/s NVLink 4, i.e. 450 GB/s each way (datasheet)
NVLINK3 = 300e9  # A100 SXM: 600 GB/s NVLink 3 (datasheet)
PCIE4 = 32e9  # PCIe 4.0 x16, each way (L40S has no NVLink)

GPU_PRESETS: dict[str, GpuSpec] = {
    "h200": GpuSpec(
        name="H200", memory_bytes=_gib(139.8), hbm_bytes_per_s=4.2e12,
        matmul_flops_per_s=790e12, fp32_flops_per_s=67e12 * MATMUL_MEASURED_OVER_DATASHEET,
        link_bytes_per_s=NVLINK4, link_latency_s=10e-6,
        source="measured on this repo's H200: x.sum() read, 8192^3 bf16 matmul "
               "(datasheet: 141 GB, 4.8 TB/s, 989 TFLOP/s); fp32 rate and NVLink: datasheet"),
    "h100": GpuSpec(
        name="H100", memory_bytes=_gib(79.11),
        hbm_bytes_per_s=3.35e12 * HBM_MEASURED_OVER_DATASHEET,
        matmul_flops_per_s=989e12 * MATMUL_MEASURED_OVER_DATASHEET,
        fp32_flops_per_s=67e12 * MATMUL_MEASURED_OVER_DATASHEET,
        link_bytes_per_s=NVLINK4, link_latency_s=10e-6,
        source="H100 SXM 80 GB HBM3; datasheet 3.35 TB/s, 989 TFLOP/s bf16 dense; derived "
               "2.93 TB/s, 790 TFLOP/s (H200 ratios); memory: torch reports 79.11 GiB"),
    "a100-80g": GpuSpec(
        name="A100-80G", memory_bytes=_gib(79.21),
        hbm_bytes_per_s=2.039e12 * HBM_MEASURED_OVER_DATASHEET,
        matmul_flops_per_s=312e12 * MATMUL_MEASURED_OVER_DATASHEET,
        fp32_flops_per_s=19.5e12 * MATMUL_MEASURED_OVER_DATASHEET,
        link_bytes_per_s=NVLINK3, link_latency_s=10e-6,
        source="A100 SXM 80 GB; datasheet 2.039 TB/s, 312 TFLOP/s bf16 dense; derived "
               "1.78 TB/s, 249 TFLOP/s (H200 ratios); memory: torch reports 79.21 GiB"),
    "l40s": GpuSpec(
        name="L40S", memory_bytes=_gib(44.4),
        hbm_bytes_per_s=0.864e12 * HBM_MEASURED_OVER_DATASHEET,
        matmul_flops_per_s=362e12 * MATMUL_MEASURED_OVER_DATASHEET,
        fp32_flops_per_s=91.6e12 * MATMUL_MEASURED_OVER_DATASHEET,
        link_bytes_per_s=PCIE4, link_latency_s=25e-6,
        source="L40S 48 GB GDDR6; datasheet 864 GB/s, 362 TFLOP/s bf16 dense; derived "
               "0.76 TB/s, 289 TFLOP/s (H200 ratios); PCIe 4.0 between cards; memory: "
               "torch reports ~44.4 GiB"),
}
GPU_ALIASES = {"a100": "a100-80g", "a100-80gb": "a100-80g", "h100-80g": "h100",
               "h100-sxm": "h100", "h200-141g": "h200", "l40s-48g": "l40s"}


def get_gpu(name: str | None = None, *, memory_gib: float | None = None,
            bandwidth_tbs: float | None = None, tflops: float | None = None,
            interconnect_gbs: float | None = None) -> GpuSpec:
    """A preset by name (default H200), with any figure given by hand replacing the
    preset's; ``name=None`` or ``"custom"`` with figures given builds a custom GPU."""
    overrides = {"memory_gib": memory_gib, "bandwidth_tbs": bandwidth_tbs, "tflops": tflops}
    given = {k: v for k, v in overrides.items() if v is not None}
    key = (name or "").strip().lower()
    if key in ("", "custom") and (given or key == "custom"):
        missing = [f"--gpu-{k.replace('_', '-')}" for k in overrides if k not in given]
        if missing:
            raise InvalidParameterError(
                f"a custom GPU needs {', '.join(missing)} as well (or pick a preset with "
                f"--gpu: {', '.join(sorted(GPU_PRESETS))})", param="gpu")
        base = GpuSpec(name="custom", memory_bytes=1, hbm_bytes_per_s=1.0,
                       matmul_flops_per_s=1.0, fp32_flops_per_s=1.0,
                       link_bytes_per_s=NVLINK4, link_latency_s=10e-6,
                       source="given by hand (--gpu-memory-gib, --gpu-bandwidth-tbs, "
                              "--gpu-tflops: the matmul rate of the chosen --dtype)")
    else:
        key = GPU_ALIASES.get(key, key or "h200")
        if key not in GPU_PRESETS:
            raise InvalidParameterError(
                f"unknown GPU {name!r}; presets: {', '.join(sorted(GPU_PRESETS))}, or "
                f"describe it with --gpu-memory-gib, --gpu-bandwidth-tbs and --gpu-tflops",
                param="gpu")
        base = GPU_PRESETS[key]
    return _override(base, given, interconnect_gbs)


def _override(base: GpuSpec, given: dict, interconnect_gbs: float | None) -> GpuSpec:
    for key, value in given.items():
        require(value > 0, f"--gpu-{key.replace('_', '-')}", f"must be > 0, got {value}")
    if interconnect_gbs is not None:
        require(interconnect_gbs > 0, "--gpu-interconnect-gbs",
                 f"must be > 0, got {interconnect_gbs}")
    if not given and interconnect_gbs is None:
        return base
    fields = dict(base.__dict__)
    if "memory_gib" in given:
        fields["memory_bytes"] = _gib(given["memory_gib"])
    if "bandwidth_tbs" in given:
        fields["hbm_bytes_per_s"] = given["bandwidth_tbs"] * 1e12
    if "tflops" in given:
        fields["matmul_flops_per_s"] = fields["fp32_flops_per_s"] = given["tflops"] * 1e12
    if interconnect_gbs is not None:
        fields["link_bytes_per_s"] = interconnect_gbs * 1e9
    if base.name != "custom":
        fields["name"] = f"{base.name} (edited)"
        fields["source"] = base.source + "; figures given by hand replace the preset's"
    return GpuSpec(**fields)
