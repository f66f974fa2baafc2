"""Mixture-of-experts layers: routing (``router``), the experts layer ``FusedMoE``
(``layer``) and how its experts are stored and multiplied (``methods``)."""

from kvflow.layers.moe.layer import FusedMoE
from kvflow.layers.moe.router import route

__all__ = ["FusedMoE", "route"]
