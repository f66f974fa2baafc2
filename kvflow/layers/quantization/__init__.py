"""Low-bit weights: one ``QuantizationConfig`` per model, a method per layer prefix.

A layer asks the config for its method (``QuantizationConfig.linear_method`` /
``embedding_method``, answered by ``registry.py``), so the model files pass a config and
module prefixes and never branch on the method (DESIGN rule 6), and ``layers/`` imports
this package only for type names. Importing it loads no torch: the methods load when a
layer asks for one.
"""

from __future__ import annotations

from kvflow.layers.quantization.config import QuantizationConfig, resolve_quantization

__all__ = ["QuantizationConfig", "resolve_quantization"]
