"""The CPU wing: everything kvflow runs only on CPUs.

- ``kernels/``: the C++ kernels the eager CPU path calls through ctypes (paged decode
  attention, int8 activation rows) and ``kernels/build.py``, the wing's one builder
  (compiler lookup, build root, the ctypes libraries and the torch extension). Floor:
  beside ``kernels/`` (imports nothing of kvflow above ``envs`` and ``logger``); the
  layers call these kernels.
- ``step.py`` + ``step.cpp`` + ``int4.cpp``: the C++ decode step (every decoder layer of
  a step in one call, its 4-bit and int8-activation GEMVs), built from the model, the
  metadata builder and the KV caches like the CUDA graph runner; ``verdict.py`` keeps
  its self-check between starts. ``compiled.py``: the opt-in inductor-compiled step;
  ``parts.py``: what both are built from (``StepParts``); ``threads.py``: the thread
  count per step; ``memory.py``: the KV cache budget from the host memory available,
  zero-filled host mappings. Floor: the worker's (the model runner
  installs them at warm-up).
"""
