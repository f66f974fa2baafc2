"""Packed weight layouts kept on disk between engine starts.

Repacking a GGUF model's blocks for the CPU (``gguf.py``: the GGML blocks to the
``Int4Groups`` form, the packed aten int4 weight, the C++ step's GEMV layout, then its
int8-activation layout at warm-up) is a few seconds of every start on a small machine,
and it computes the same bytes each time. Each layout is stored once, under a key that
hashes everything it is a function of: the layer's source bytes (its GGML blocks and
types), the layout code (the source of ``packed.py``, ``ggml_blocks.py`` and ``gguf.py``,
plus ``VERSION``), torch's version (the aten int4 packing is torch's) and the CPU's
feature flags (that packing follows the ISA). A changed file, model, kvflow or torch
therefore misses and repacks; nothing is ever looked up by path alone.

Entries are safetensors files in the build cache root (beside the C++ CPU kernels),
written to a temporary name and renamed (a reader never sees half a file), and carry a
CRC32 of their tensors' bytes: an entry that does not load, lacks a tensor, or whose
bytes no longer match is logged, deleted and rebuilt, never used. The folder is kept
under ``MAX_BYTES`` by dropping the least recently used entries.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import torch

from kvflow.cpu.kernels import build
from kvflow.logger import init_logger

logger = init_logger(__name__)

VERSION = 1  # bump when a stored layout changes meaning without its source changing
MAX_BYTES = 4 << 30  # the folder's size bound (least recently used entries go first)
_CODE = ("packed.py", "ggml_blocks.py", "gguf.py")


def cache_root() -> Path:
    """``layouts`` in the CPU wing's build root (beside the C++ builds)."""
    return build.build_root() / "layouts"


_salt: bytes | None = None


def _code_salt() -> bytes:
    """What every key shares: the layout code, VERSION, torch and the CPU (once per
    process)."""
    global _salt
    if _salt is None:
        h = hashlib.sha256(f"v{VERSION} torch {torch.__version__}\0".encode())
        here = Path(__file__).parent
        for name in _CODE:
            h.update((here / name).read_bytes())
        try:
            with open("/proc/cpuinfo") as f:
                h.update(next((line for line in f if line.startswith("flags")), "").encode())
        except OSError:
            pass
        _salt = h.digest()
    return _salt


def key(kind: str, *parts) -> str:
    """The key of a layout of ``kind`` computed from ``parts`` (bytes-like objects,
    numpy arrays, tensors, or anything with a stable ``repr``)."""
    h = hashlib.sha256(_code_salt() + kind.encode() + b"\0")
    for p in parts:
        if isinstance(p, torch.Tensor):
            p = p.contiguous().view(torch.uint8).numpy() if p.numel() else b""
        elif isinstance(p, np.ndarray):  # a rank's shard of blocks is a strided view
            p = np.ascontiguousarray(p)
        if hasattr(p, "tobytes") or isinstance(p, (bytes, bytearray, memoryview)):
            data = memoryview(p).cast("B") if not isinstance(p, bytes) else p
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        else:
            h.update(repr(p).encode() + b"\0")
    return f"{kind}-{h.hexdigest()[:32]}"


def _crc(tensors: dict[str, torch.Tensor]) -> str:
    crc = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        crc = zlib.crc32(name.encode(), crc)
        if t.numel():
            crc = zlib.crc32(t.view(torch.uint8).numpy(), crc)
    return str(crc)


class Stats:
    """Entries read, written and refused since the last ``take`` (one log line per model
    load or warm-up, not one per layer)."""

    def __init__(self) -> None:
        self.take()

    def take(self) -> tuple[int, int, int, float]:
        """(read, written, refused, seconds spent reading and writing); resets them."""
        out = getattr(self, "read", 0), getattr(self, "written", 0), \
            getattr(self, "refused", 0), getattr(self, "seconds", 0.0)
        self.read = self.written = self.refused = 0
        self.seconds = 0.0
        return out


stats = Stats()


def get(name: str, tensors: tuple[str, ...] | None) -> tuple[dict[str, torch.Tensor],
                                                              dict[str, str]] | None:
    """The entry ``name`` (a ``key``): its tensors (exactly those named, unless None) and
    its metadata, or None when it is missing, or unreadable or damaged (then deleted)."""
    path = cache_root() / f"{name}.safetensors"
    if not path.exists():
        return None
    start = time.perf_counter()
    try:
        from safetensors.torch import load

        # Read, not mapped: a mapped file's tensors fault in 4 KiB at a time when first
        # read, which cost 1.5 s for SmolLM2's int8 layouts on a busy 2-core machine.
        data = path.read_bytes()
        n = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8:8 + n]).get("__metadata__") or {}
        got = load(data)
        problem = None
        if meta.get("key") != name:
            problem = "written for another key"
        elif tensors is not None and set(got) != set(tensors):
            problem = f"holds {sorted(got)}, not {sorted(tensors)}"
        elif meta.get("crc32") != _crc(got):
            problem = "its bytes do not match their checksum"
    except Exception as e:  # truncated, not safetensors, unreadable
        problem = f"{type(e).__name__}: {str(e).strip()[:120]}"
    if problem is not None:
        logger.warning("packed layout cache entry %s is damaged or stale (%s): deleted, "
                       "repacking", path, problem)
        path.unlink(missing_ok=True)
        stats.refused += 1
        return None
    try:
        os.utime(path)  # least recently used goes first when the folder is trimmed
    except OSError:
        pass
    stats.read += 1
    stats.seconds += time.perf_counter() - start
    return got, meta


def put(name: str, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None
        ) -> None:
    """Store ``tensors`` under ``name``; a full disk or read-only cache only logs."""
    from safetensors.torch import save_file

    start = time.perf_counter()
    root = cache_root()
    tensors = {n: t.detach().contiguous() for n, t in tensors.items()}
    meta = {**(meta or {}), "key": name, "crc32": _crc(tensors)}
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=root)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=meta)
            os.replace(tmp, root / f"{name}.safetensors")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        logger.warning("could not write the packed layout cache in %s (%s); the next start "
                       "repacks", root, e)
        return
    stats.written += 1
    stats.seconds += time.perf_counter() - start


def trim(limit: int = MAX_BYTES) -> None:
    """Drop the least recently used entries while the folder holds more than ``limit``."""
    try:
        entries = [(p.stat().st_mtime, p.stat().st_size, p)
                   for p in cache_root().glob("*.safetensors")]
    except OSError:
        return
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= limit:
            break
        path.unlink(missing_ok=True)
        total -= size


def log_summary(what: str) -> None:
    """One line for the entries read or written since the last summary (none: silent)."""
    read, written, refused, seconds = stats.take()
    if written:
        trim()
    if read or written:
        logger.info("%s: %d packed layouts read from the cache, %d written to it%s (%.1f s; "
                    "%s)", what, read, written, f", {refused} damaged ones repacked"
                    if refused else "", seconds, cache_root())
