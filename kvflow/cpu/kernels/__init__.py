"""C++ kernels for the CPU path, one kernel per ``.cpp`` file with a Python wrapper of
the same name beside it (built once per machine by ``build.py``, called via ctypes):

- ``paged_attention``: decode attention reading the paged KV cache in place (int8 with
  per-token scales, fp8 E4M3, float32), no gathered or dequantized copy; its code is in
  ``paged_attention.h``, which the C++ decode step compiles too.
- ``quant_rows``: per-token int8 quantization of a few activation rows (the W8A8
  methods at decode) in one call instead of nine torch ops.
"""
