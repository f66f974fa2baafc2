"""The GGUF container's header, read directly: metadata key-values and the tensor directory.

gguf.GGUFReader builds numpy views for every part of every field, which takes seconds on a
vocabulary's string arrays (about 4 s for SmolLM2's 49k tokens and 48k merges); walking the
header with ``struct`` takes a fraction of that. No torch here: the API process reads the
tokenizer metadata with it. GGUF versions 2 and 3, little-endian (what llama.cpp writes).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from kvflow.errors import ModelLoadError
from kvflow.utils import cdiv

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
            11: "q", 12: "d"}  # GGUF value type -> struct code
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # ggml order: the fastest-varying dimension first
    ggml_type: int
    offset: int  # absolute byte offset of the data in the file

    @property
    def numpy_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))

    @property
    def num_elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    fields: dict[str, Any]
    tensors: tuple[GGUFTensor, ...]

    def field(self, key: str, default: Any = None) -> Any:
        value = self.fields.get(key)
        return default if value is None else value


def read_gguf_header(path: str, prefix: str = "", tensors: bool = True) -> GGUFHeader:
    """The metadata whose keys start with ``prefix`` and (optionally) the tensor directory.
    A damaged or unsupported file raises ModelLoadError."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return _Parser(m).header(prefix, tensors)
    except ModelLoadError:
        raise
    except (OSError, ValueError, struct.error, UnicodeDecodeError, OverflowError) as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file (truncated or corrupt?): "
                             f"{type(e).__name__}: {e}") from None


@lru_cache(maxsize=4)
def cached_gguf_header(path: str) -> GGUFHeader:
    """The whole header, parsed once per path (architecture, then weights, read it)."""
    return read_gguf_header(path)


class _Parser:
    def __init__(self, m: mmap.mmap) -> None:
        self.m = m

    def header(self, prefix: str, want_tensors: bool) -> GGUFHeader:
        m = self.m
        if m[:4] != b"GGUF":
            raise ValueError("no GGUF magic number at the start of the file")
        (version,) = struct.unpack_from("<I", m, 4)
        if version not in (2, 3):
            raise ModelLoadError(
                f"GGUF version {version} is not supported (versions 2 and 3, little-endian; "
                "re-convert the model with a current llama.cpp)")
        n_tensors, n_kv = struct.unpack_from("<QQ", m, 8)
        fields, pos = {}, 24
        for _ in range(n_kv):
            key, pos = self.string(pos)
            (kind,) = struct.unpack_from("<I", m, pos)
            keep = key.startswith(prefix) or key == "general.alignment"
            value, pos = (self.value if keep else self.skip)(kind, pos + 4)
            if keep:
                fields[key] = value
        infos = []
        if want_tensors:
            for _ in range(n_tensors):
                name, pos = self.string(pos)
                (n_dims,) = struct.unpack_from("<I", m, pos)
                shape = struct.unpack_from(f"<{n_dims}Q", m, pos + 4)
                pos += 4 + 8 * n_dims
                ggml_type, offset = struct.unpack_from("<IQ", m, pos)
                pos += 12
                infos.append((name, tuple(shape), ggml_type, offset))
            align = int(fields.get("general.alignment", _DEFAULT_ALIGNMENT))
            start = cdiv(pos, align) * align
            names = [i[0] for i in infos]
            if len(set(names)) != len(names):
                raise ValueError("a tensor name occurs twice")
            infos = [GGUFTensor(n, s, t, start + o) for n, s, t, o in infos]
        return GGUFHeader(version, fields, tuple(infos))

    def string(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self.m, pos)
        if pos + 8 + n > len(self.m):
            raise ValueError("a string runs past the end of the file")
        return self.m[pos + 8:pos + 8 + n].decode("utf-8"), pos + 8 + n

    def value(self, kind: int, pos: int) -> tuple[Any, int]:
        m = self.m
        if kind == _STRING:
            return self.string(pos)
        if kind in _SCALARS:
            code = "<" + _SCALARS[kind]
            return struct.unpack_from(code, m, pos)[0], pos + struct.calcsize(code)
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, n = struct.unpack_from("<IQ", m, pos)
        pos += 12
        if item in _SCALARS:
            code = f"<{n}{_SCALARS[item]}"
            return list(struct.unpack_from(code, m, pos)), pos + struct.calcsize(code)
        items = []
        for _ in range(n):
            v, pos = self.value(item, pos)
            items.append(v)
        return items, pos

    def skip(self, kind: int, pos: int) -> tuple[None, int]:
        """Step over a value without building it."""
        m = self.m
        if kind == _STRING:
            (n,) = struct.unpack_from("<Q", m, pos)
            return None, pos + 8 + n
        if kind in _SCALARS:
            return None, pos + struct.calcsize("<" + _SCALARS[kind])
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, n = struct.unpack_from("<IQ", m, pos)
        pos += 12
        if item in _SCALARS:
            return None, pos + n * struct.calcsize("<" + _SCALARS[item])
        for _ in range(n):
            _, pos = self.skip(item, pos)
        if pos > len(m):
            raise ValueError("an array runs past the end of the file")
        return None, pos
