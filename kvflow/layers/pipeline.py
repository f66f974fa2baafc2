"""Pipeline-parallel layer placement: each stage builds only its contiguous range of
decoder layers; the others are parameterless placeholders that keep the layer indices
(and so the checkpoint names, ``model.layers.17...``) of the full model."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from kvflow.config import ParallelConfig
from kvflow.distributed.parallel_state import GroupCoordinator


class MissingLayer(nn.Module):
    """A layer another pipeline stage holds."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this layer lives on another pipeline stage")


def make_layers(num_layers: int, pp: GroupCoordinator | None,
                build: Callable[[int], nn.Module]) -> tuple[nn.ModuleList, int, int]:
    """(layers, start, end): ``build(i)`` for the layers of this stage, placeholders for
    the rest. One stage (``pp`` None or of size 1) holds them all."""
    if pp is None or pp.world_size == 1:
        return nn.ModuleList(build(i) for i in range(num_layers)), 0, num_layers
    cfg = ParallelConfig(pipeline_parallel_size=pp.world_size, stage=pp.rank_in_group)
    start, end = cfg.stage_layers(num_layers)
    return (nn.ModuleList(build(i) if start <= i < end else MissingLayer()
                          for i in range(num_layers)), start, end)
