"""Measured tuning data per GPU, read from one data file per device.

Each ``*.json`` file in this folder holds what the benchmarks measured on one GPU model:

- ``match``: a token of ``torch.cuda.get_device_name()`` that picks the file ("H100");
- ``decode_switches``: the decode levers measured faster there ({"rope_in_attn": true,
  ...}; a switch left out is off: ``kernels/decode_defaults.py``);
- ``gemv``: the dense decode GEMV's table (``kernels/gemv_config.py``): rows
  ``{"kind", "n", "k", "m", "config"}``, ``n`` the layer's output width (d for the SiLU
  forms), ``m`` the row bucket, ``config`` a ``GemvConfig``'s fields or null (cuBLAS
  measured faster);
- ``woq_gemv``: the low-bit decode GEMVs' table (``kernels/woq_gemv_config.py``): rows
  ``{"format", "n", "k", "m", "config"}``;
- ``fused_moe``: the fused MoE kernel's launch configurations (``kernels/fused_moe.py``):
  rows ``{"max_tokens", "block_m", "block_n", "block_k", "num_warps", "num_stages"}``,
  the first row whose ``max_tokens`` covers a step's tokens is used;
- ``sources``: the result files each part came from (tests tie the tables to them).

A GPU without a file gets the safe defaults (cuBLAS for dense decode rows, the low-bit
kernels' heuristic tiles, every switch off) and one log line saying how to measure it.
``KVFLOW_TUNING_FILE`` (comma-separated paths) overlays files of the same form, or result
files of ``benchmarks/gpu/bench_gemv.py`` / ``bench_woq_gemv.py`` / ``bench_fp8_gemv.py``
(their ``table``), on the device's data: a fresh measurement tried without editing
anything. The benchmark scripts write their tables into a file of this folder with
``--write-tuning``.
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

DATA_DIR = os.path.dirname(os.path.abspath(__file__))
SECTIONS = ("gemv", "woq_gemv")
MEASURE_HINT = ("measure it with `benchmarks/gpu/run.sh gemv-fresh woq-gemv` and write the "
                "tables with the bench scripts' --write-tuning (docs/decode-gemv.md)")

Table = dict  # {(kind or format, n, k): {m bucket: config fields (dict) or None}}


@dataclass(frozen=True)
class Tuning:
    """The measured data in force for one device."""

    device: str
    """The device name it was chosen for."""
    files: tuple[str, ...] = ()
    """The data files it came from (the device's, then KVFLOW_TUNING_FILE's); empty: none."""
    switches: dict = field(default_factory=dict)
    """Decode switches measured faster on this device (name -> value)."""
    gemv: Table = field(default_factory=dict)
    """The dense decode GEMV's table."""
    woq_gemv: Table = field(default_factory=dict)
    """The low-bit decode GEMVs' table."""
    fused_moe: list = field(default_factory=list)
    """The fused MoE launch rows by ``max_tokens``; empty: the kernel's defaults."""


def _rows_to_table(rows: list[dict], key: str, halve_silu: bool = False) -> Table:
    table: Table = {}
    for r in rows:
        n = r["n"] // 2 if halve_silu and r[key].endswith("silu_mul") else r["n"]
        table.setdefault((r[key], n, r["k"]), {})[r["m"]] = r["config"]
    return table


def table_rows(table: Table, key: str) -> list[dict]:
    """A table as the rows a data file stores, sorted (stable files, readable diffs)."""
    return [{key: kind, "n": n, "k": k, "m": m, "config": buckets[m]}
            for (kind, n, k), buckets in sorted(table.items()) for m in sorted(buckets)]


def parse(data: dict) -> dict:
    """A data file or a bench result as {"switches", "gemv", "woq_gemv"} (parts absent
    from it left out)."""
    if "table" in data and not any(s in data for s in SECTIONS):  # a bench result
        rows = data["table"]
        if not rows:
            return {}
        if "kind" in rows[0]:  # bench_gemv.py: n is the weight's rows (2d for SiLU forms)
            return {"gemv": _rows_to_table(rows, "kind", halve_silu=True)}
        return {"woq_gemv": _rows_to_table(rows, "format")}
    out: dict = {}
    if "fused_moe" in data:
        out["fused_moe"] = sorted(data["fused_moe"], key=lambda r: r["max_tokens"])
    if "decode_switches" in data:
        out["switches"] = dict(data["decode_switches"])
    if "gemv" in data:
        out["gemv"] = _rows_to_table(data["gemv"], "kind")
    if "woq_gemv" in data:
        out["woq_gemv"] = _rows_to_table(data["woq_gemv"], "format")
    return out


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def device_file(name: str) -> str | None:
    """The data file whose ``match`` token is in the device name ``name``, if any."""
    for path in sorted(glob.glob(os.path.join(DATA_DIR, "*.json"))):
        if _load(path).get("match", "\0") in name:
            return path
    return None


@functools.lru_cache(maxsize=16)
def for_device(name: str, overrides: str | None = None) -> Tuning:
    """The tuning data for the GPU called ``name``: its data file, then each file of
    ``overrides`` (``KVFLOW_TUNING_FILE``'s value) overlaid part by part (a table's
    buckets replace the same buckets; switches replace switches)."""
    parts: dict = {"switches": {}, "gemv": {}, "woq_gemv": {}, "fused_moe": []}
    files = []
    own = device_file(name)
    extra = [p for p in (overrides or "").split(",") if p]
    for path in ([own] if own else []) + extra:
        files.append(path)
        for part, value in parse(_load(path)).items():
            if part == "switches":
                parts["switches"].update(value)
                continue
            if part == "fused_moe":  # a launch table is replaced whole
                parts["fused_moe"] = value
                continue
            for key, buckets in value.items():
                parts[part][key] = {**parts[part].get(key, {}), **buckets}
    if own is None:
        logger.info("no measured tuning data for GPU %r in %s: decode runs its safe defaults; "
                    "%s", name, DATA_DIR, MEASURE_HINT)
    return Tuning(device=name, files=tuple(files), **parts)


def current(device=None) -> Tuning:
    """The tuning data of a CUDA ``device`` (default: the current one), with the
    ``KVFLOW_TUNING_FILE`` overlays."""
    import torch

    from kvflow import envs

    index = device.index if device is not None and device.index is not None else (
        torch.cuda.current_device())
    return for_device(torch.cuda.get_device_name(index), envs.tuning_file())


def write(path: str, match: str, section: str, table: Table, source: str) -> None:
    """Merge a measured table into the data file ``path`` (created with ``match`` if it
    does not exist): its buckets replace the file's, ``source`` is recorded."""
    assert section in SECTIONS
    data = _load(path) if os.path.exists(path) else {"match": match, "decode_switches": {},
                                                     "gemv": [], "woq_gemv": [],
                                                     "sources": {}}
    key = "kind" if section == "gemv" else "format"
    merged = _rows_to_table(data.get(section, []), key)
    for k, buckets in table.items():
        merged[k] = {**merged.get(k, {}), **buckets}
    data[section] = table_rows(merged, key)
    data.setdefault("sources", {}).setdefault(section, [])
    if source not in data["sources"][section]:
        data["sources"][section].append(source)
    with open(path, "w") as f:
        f.write(dumps(data))


def write_rows(path: str, match: str, section: str, rows: list[dict], source: str) -> None:
    """Replace the row list ``section`` (``fused_moe``) of the data file ``path`` (created
    with ``match`` if it does not exist), ``source`` recorded."""
    data = _load(path) if os.path.exists(path) else {"match": match, "sources": {}}
    data[section] = rows
    data.setdefault("sources", {})[section] = [source]
    with open(path, "w") as f:
        f.write(dumps(data))


def write_bench(path: str, result: dict, source: str) -> None:
    """Merge a bench result's measured ``table`` (bench_gemv.py, bench_woq_gemv.py,
    bench_fp8_gemv.py) into the data file ``path``, for the GPU it ran on."""
    import torch

    for section, table in parse(result).items():
        if section in SECTIONS:
            write(path, match_token(torch.cuda.get_device_name()), section, table, source)


def match_token(name: str) -> str:
    """The token a new data file matches the device name ``name`` by: its model word
    ("NVIDIA H100 80GB HBM3" -> "H100")."""
    words = [w for w in name.replace("-", " ").split() if w.upper() != "NVIDIA"]
    return words[0] if words else name


def dumps(data: dict) -> str:
    """A data file's text: one line per table row, so a re-measured bucket is a one-line
    diff."""
    parts = []
    for key, value in data.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            rows = ",\n".join("  " + json.dumps(r) for r in value)
            parts.append(f"{json.dumps(key)}: [\n{rows}\n ]")
        else:
            parts.append(f"{json.dumps(key)}: {json.dumps(value)}")
    return "{\n " + ",\n ".join(parts) + "\n}\n"
