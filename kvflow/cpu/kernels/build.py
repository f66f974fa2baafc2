"""Build and load kvflow's C++ CPU code, once per machine: the one builder of the CPU wing
(one compiler lookup, ``find_compiler``; one build root, ``build_root``).

Two kinds of library are built here. The C++ step (``kvflow/cpu/step.cpp`` with
``int4.cpp``) links against torch and is built by ``load_extension`` with
``torch.utils.cpp_extension`` into a folder of its own under the build root (a minute or
two, once). The kernels are built by ``load``: a kernel is one ``.cpp`` file in this folder with a plain C ABI (no torch headers, so it
builds in about a second) called through ctypes; code it shares with the C++ decode step
lives in a ``.h`` beside it. It is compiled with the system C++
compiler (``$CXX``, else ``c++``/``g++``/``clang++``) into the build root
(``kvflow`` in ``$TORCH_EXTENSIONS_DIR``, else in ``~/.cache/torch_extensions``); the file name carries a hash of the source, the flags
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
import sys
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
    """Where every build (and the start caches beside them) lives: ``kvflow`` in torch's
    extension cache folder (``$TORCH_EXTENSIONS_DIR``, else torch's default)."""
    root = envs.torch_extensions_dir()
    if root is None:
        # What cpp_extension.get_default_build_root returns, without importing
        # cpp_extension (a third of a second of every start).
        from torch import _appdirs

        root = os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions"))
    return Path(root) / "kvflow"


def load(name: str, functions: dict[str, tuple[list, object]] | None = None
         ) -> ctypes.CDLL | None:
    """The built library of ``<name>.cpp`` (built now if missing), or None when it cannot
    be built here; the outcome is logged once per process. ``functions``: each exported
    function's (argtypes, restype), set once on the loaded library."""
    with _lock:
        if name not in _loaded:
            _loaded[name] = _load(name)
        lib = _loaded[name]
        if lib is not None and functions and not hasattr(lib, "_kvflow_typed"):
            for fname, (argtypes, restype) in functions.items():
                fn = getattr(lib, fname)
                fn.argtypes, fn.restype = argtypes, restype
            lib._kvflow_typed = True
        return lib


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


# --- the torch extension (the C++ step) ---------------------------------------------------

_extensions: dict[str, object] = {}


def extension_dir(name: str, sources: list[Path], cflags: list[str]) -> Path:
    """The build folder of extension ``name``. Its name carries a hash of the sources, the
    flags, the compiler, torch's version and the CPU's feature flags (-march=native): ninja
    alone compares times, so another checkout's older but different copy, or a cache
    shared with another CPU, would load a library built from something else. The torch
    and Python installation count too: build.ninja names their include folders, so two
    virtual environments (even with the same torch version) need folders of their own or
    each start would rebuild the other's library. The checkout does not (the build reads
    copies of the sources, see ``_copy_sources``)."""
    import torch

    key = hashlib.sha256(b"".join(p.read_bytes() for p in sources))
    key.update(" ".join(cflags).encode() + torch.__version__.encode())
    key.update(str(find_compiler()).encode())
    key.update(os.path.dirname(torch.__file__).encode() + sys.prefix.encode())
    key.update(_cpu_flags().encode())
    return build_root() / f"{name}-{key.hexdigest()[:12]}"


def _ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH; the pip package (a dependency) installs it
    beside the interpreter, which is not on PATH when the venv is not activated."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return  # cpp_extension then raises, and the caller falls back
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _copy_sources(build_dir: Path, sources: list[Path], compiled: list[Path]) -> list[Path]:
    """``sources`` (the compiled ones and the headers they include), copied into the build
    folder with their layout below the kvflow package kept, so that the generated
    build.ninja names the same files whichever checkout holds kvflow: ninja rebuilds
    whenever build.ninja changes, so two checkouts of the same source that built from
    their own paths would rebuild each other's library on every start. Returns the
    copies of ``compiled``."""
    pkg = HERE.parent.parent
    out = []
    for path in sources:
        dest = build_dir / "src" / path.resolve().relative_to(pkg)
        data = path.read_bytes()
        if not dest.exists() or dest.read_bytes() != data:
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_suffix(dest.suffix + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, dest)  # the hash in the folder name says the content is equal
        if path in compiled:
            out.append(dest)
    return out


def load_extension(name: str, compiled: list[Path], headers: list[Path],
                   cflags: list[str], what: str):
    """Build (first time) or load the torch extension ``name`` from the ``compiled``
    sources (which include ``headers``), with the compiler ``find_compiler`` picked;
    returns (module, seconds). A missing compiler or a failed build raises (the caller
    falls back and logs); ``what`` names it in the log lines around a build."""
    if name in _extensions:
        return _extensions[name], 0.0
    cxx = find_compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (install g++ or set CXX)")
    from torch.utils import cpp_extension

    start = time.perf_counter()
    _ninja_on_path()
    build_dir = extension_dir(name, compiled + headers, cflags)
    build_dir.mkdir(parents=True, exist_ok=True)
    # cpp_extension's own lock is a file that a build killed midway leaves behind (and
    # the next start would wait on forever); an flock dies with its process, and whoever
    # holds it may remove such a leftover.
    with open(build_dir / "kvflow.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        copies = _copy_sources(build_dir, compiled + headers, compiled)
        fresh = not (build_dir / f"{name}.so").exists()
        if fresh:
            logger.info("building %s once for this environment (a minute or two; later "
                        "starts load it) in %s", what, build_dir)
        # cpp_extension compiles with $CXX, else c++: the compiler found above.
        saved = os.environ.get("CXX")
        os.environ["CXX"] = cxx
        try:
            module = cpp_extension.load(name=name, sources=[str(p) for p in copies],
                                        extra_cflags=cflags, extra_ldflags=["-fopenmp"],
                                        build_directory=str(build_dir), verbose=False)
        finally:
            if saved is None:
                os.environ.pop("CXX", None)
            else:
                os.environ["CXX"] = saved
    seconds = time.perf_counter() - start
    if fresh:
        logger.info("built %s in %.1f s", what, seconds)
    _extensions[name] = module
    return module, seconds
