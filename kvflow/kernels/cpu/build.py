"""Build and load kvflow's C++ CPU kernels, once per machine.

A kernel is one ``.cpp`` file in this folder with a plain C ABI (no torch headers, so it
builds in about a second) called through ctypes; code it shares with the C++ decode step
lives in a ``.h`` beside it. It is compiled with the system C++
compiler (``$CXX``, else ``c++``/``g++``) into torch's extension cache folder
(``torch.utils.cpp_extension.get_default_build_root()``, i.e. ``$TORCH_EXTENSIONS_DIR``
or ``~/.cache/torch_extensions``); the file name carries a hash of the source, the flags
and the CPU's feature flags, so an edit, another compiler setting or a cache copied to a
different CPU builds afresh and an unchanged one is loaded from disk.

OpenMP: the library links ``libgomp.so.1``, which resolves to the copy torch already
loaded, so kernels and torch ops share one thread pool (two pools would spin against
each other on a small machine).

``load`` returns None (and logs why, once) when there is no compiler or the build fails:
callers keep their torch path.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from kvflow import envs
from kvflow.logger import init_logger

logger = init_logger(__name__)

HERE = Path(__file__).resolve().parent
# -march=native: the library is built on the machine that runs it (the hash below keys
# it by CPU). No -ffast-math: the kernels rely on IEEE infinities; `omp simd` pragmas
# mark the only reductions whose order may change. -ffp-contract=off, as the C++ decode
# step is built: the fused multiply-adds are the explicit ones (fma8/fmadd), so the
# shared paged attention kernel rounds alike in both libraries.
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno",
         "-fno-trapping-math", "-fopenmp", "-std=c++17", "-shared", "-fPIC"]

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def find_compiler() -> str | None:
    """The C++ compiler to build with: $CXX when set (even if missing: then none), else
    the first of c++, g++, clang++ on PATH."""
    cxx = envs.cxx()
    if cxx is not None:
        return shutil.which(cxx)
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiled for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def build_root() -> Path:
    """Where the libraries live: torch's extension cache folder, as torch picks it."""
    root = envs.torch_extensions_dir()
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        root = get_default_build_root()
    return Path(root) / "kvflow"


def load(name: str) -> ctypes.CDLL | None:
    """The built library of ``<name>.cpp`` (built now if missing), or None when it cannot
    be built here; the outcome is logged once per process."""
    with _lock:
        if name not in _loaded:
            _loaded[name] = _load(name)
        return _loaded[name]


def _load(name: str) -> ctypes.CDLL | None:
    if not envs.cpu_kernels():
        logger.info("C++ CPU kernel %s off (KVFLOW_CPU_KERNELS=0): using the torch path",
                    name)
        return None
    cxx = find_compiler()
    if cxx is None:
        logger.info("C++ CPU kernel %s unavailable: no C++ compiler found (install g++ or "
                    "set CXX); using the torch path", name)
        return None
    source = HERE / f"{name}.cpp"
    # The headers beside it count too (paged_attention.h holds that kernel's code).
    text = b"\0".join(p.read_bytes() for p in [source, *sorted(HERE.glob("*.h"))])
    key = hashlib.sha256(b"\0".join([text, " ".join(FLAGS).encode(), cxx.encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    root = build_root()
    lib = root / f"{name}-{key}.so"
    try:
        root.mkdir(parents=True, exist_ok=True)
        # One builder at a time per library (engine processes may start together).
        with open(root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if lib.exists():
                how = "loaded from"
            else:
                start = time.perf_counter()
                _compile(cxx, source, lib)
                how = f"built in {time.perf_counter() - start:.1f} s into"
        handle = ctypes.CDLL(str(lib))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        first = detail.strip().splitlines()[0] if detail.strip() else type(e).__name__
        logger.warning("C++ CPU kernel %s could not be built or loaded (%s); using the torch "
                       "path", name, first)
        return None
    logger.info("C++ CPU kernel %s: %s %s", name, how, lib)
    return handle


def _compile(cxx: str, source: Path, lib: Path) -> None:
    """Compile to a temporary file, then rename: a reader never sees half a library."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    try:
        subprocess.run([cxx, *FLAGS, str(source), "-o", tmp], check=True,
                       capture_output=True, text=True)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
