"""The C++ CPU step's self-check verdict, kept between engine starts.

The self-check (``CppDecodeStep.self_check`` and ``gemv_error``) runs throw-away steps
through the C++ step and the eager path and compares them: a second or so on a quiet
2-core machine, 8-15 s on a busy one, at every engine start. Its outcome is a function
of the build, the weights, the engine's configuration and kvflow's code, so a passed
check is recorded under a key that hashes all four:

- the C++ build: its folder name (a hash of the sources, flags, torch, Python
  installation and CPU flags, ``step.build_root``);
- the model: its file (path, size, modification time and a hash of the GGUF header with
  its tensor index) or the folder's weight files (name, size, modification time) and
  its config.json; a model without files (``--load-format dummy``) is never recorded;
- the configuration: the engine's model, cache and device settings, the KV cache's
  dtype and shape (all but its block count) and what the step took on (linears called
  back, 4-bit GEMVs, int8 activations and their ISA, KV cache kind);
- the code: every ``.py``, ``.cpp`` and ``.h`` file of the kvflow package (the eager
  reference is part of the check).

A hit skips the check and says so in the step's log line; any change reruns it. Only
passes are recorded (a failure must be seen each start). A record that does not parse,
names another key or holds figures past the tolerances is deleted and the check reruns.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

from kvflow.layers.quantization import layout_cache
from kvflow.logger import init_logger

logger = init_logger(__name__)

MAX_RECORDS = 256  # newest kept (tests write one per temporary model file)
_code_hash: str | None = None


def records_root() -> Path:
    """``<torch extensions dir>/kvflow/checks``, beside the packed layouts."""
    return layout_cache.cache_root().parent / "checks"


def code_hash() -> str:
    """A hash of kvflow's sources (about 250 files, ~30 ms; once per process)."""
    global _code_hash
    if _code_hash is None:
        pkg = Path(__file__).resolve().parent.parent
        h = hashlib.sha256()
        for p in sorted(pkg.rglob("*")):
            if p.suffix in (".py", ".cpp", ".h") and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(pkg)).encode() + b"\0" + p.read_bytes())
        _code_hash = h.hexdigest()
    return _code_hash


def model_identity(path: str | None, load_format: str) -> str | None:
    """What identifies the model's weights on disk, or None (no files: not recorded)."""
    if load_format == "dummy" or not path or not os.path.exists(path):
        return None
    real = os.path.realpath(path)
    h = hashlib.sha256(real.encode() + b"\0" + load_format.encode())
    if os.path.isfile(real):
        st = os.stat(real)
        h.update(f"{st.st_size} {st.st_mtime_ns}".encode())
        if real.endswith(".gguf"):
            from kvflow.models.gguf_header import cached_gguf_header

            header = cached_gguf_header(path)
            start = min((t.offset for t in header.tensors), default=0)
            with open(real, "rb") as f:  # the header and tensor index, as stored
                h.update(f.read(min(start, 64 << 20)))
        return h.hexdigest()
    for name in sorted(os.listdir(real)):
        p = os.path.join(real, name)
        if os.path.isfile(p):
            st = os.stat(p)
            h.update(f"{name} {st.st_size} {st.st_mtime_ns}\0".encode())
            if name == "config.json":
                with open(p, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def record_key(build: str, model: str, config: str) -> str:
    return hashlib.sha256("\0".join([build, model, config, code_hash()]).encode()
                          ).hexdigest()[:32]


def lookup(key: str, tolerances: dict[str, float]) -> dict | None:
    """The recorded figures of a passed check under ``key``, or None (then the check
    runs); a damaged record, or one whose figures fail ``tolerances``, is deleted."""
    path = records_root() / f"{key}.json"
    if not path.exists():
        return None
    try:
        rec = json.loads(path.read_text())
        ok = rec.get("key") == key and all(
            isinstance(rec.get(k), (int, float)) and rec[k] <= tol
            for k, tol in tolerances.items())
    except (OSError, ValueError, AttributeError):
        ok = False
    if not ok:
        logger.warning("C++ CPU step self-check record %s is damaged or stale: deleted, "
                       "checking again", path)
        path.unlink(missing_ok=True)
        return None
    return rec


def store(key: str, figures: dict[str, float]) -> None:
    """Record a passed check (a read-only or full cache only logs)."""
    root = records_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=root)
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       **figures}, f)
        os.replace(tmp, root / f"{key}.json")
        records = sorted(root.glob("*.json"), key=lambda p: p.stat().st_mtime)
        for old in records[:-MAX_RECORDS]:
            old.unlink(missing_ok=True)
    except OSError as e:
        logger.warning("could not record the C++ CPU step's self-check in %s (%s)", root, e)
        return
    logger.info("C++ CPU step self-check passed: recorded in %s (later starts of this "
                "build, model and configuration skip it)", root / f"{key}.json")
