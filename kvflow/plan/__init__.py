"""``kvflow plan``: what a model needs and how fast it runs on a GPU, before loading it.

``gpus`` (GPU presets), ``efficiency`` (measured overheads), ``model`` (per-GPU shapes and
the cost of one step), ``memory`` (the engine's KV budget), ``simulate`` (an offline
run), ``planner`` (``build_plan``), ``report`` (table, JSON, chart), ``validate``
(against measured H200 runs). Pure Python: nothing here imports torch.
"""

from kvflow.plan.gpus import GPU_PRESETS, GpuSpec, get_gpu
from kvflow.plan.planner import Plan, PlanInputs, build_plan

__all__ = ["GPU_PRESETS", "GpuSpec", "get_gpu", "Plan", "PlanInputs", "build_plan"]
