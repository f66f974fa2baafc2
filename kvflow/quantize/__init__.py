"""Offline quantization: ``kvflow quantize --method smoothquant`` (calibrate, smooth,
quantize, write a checkpoint kvflow loads)."""
