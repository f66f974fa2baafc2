"""Small helpers shared across the package (no torch: kvflow.core imports these)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of integers: how many ``b``-sized pieces cover ``a``."""
    return -(-a // b)
