"""PEFT LoRA adapters: read a directory (adapter_config.json + adapter_model.safetensors),
check it against the base model, and hold its A/B matrices on the host.

An adapter is refused as a whole, with a message naming what is wrong, before anything
of it reaches the engine: a missing file, another adapter type (DoRA, IA3, ...), a rank
above ``--max-lora-rank``, a module the engine cannot adapt (embeddings, lm_head,
``modules_to_save``), or a matrix whose shape is not the base layer's.

Scaling follows PEFT: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with
``use_rslora``; ``alpha_pattern`` / ``rank_pattern`` override per module. The scale is
folded into B so the kernels only multiply.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from kvflow.config import ModelArchConfig
from kvflow.errors import InvalidParameterError
from kvflow.lora.config import LoRAConfig

# The linears an adapter may target, by their Hugging Face names, and the merged kvflow
# layer (and its slice) each lives in.
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
                  r"(\w+)\.lora_(A|B)(?:\.[\w-]+)?\.weight$")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def module_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each adaptable linear of the base model."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv, i = arch.num_attention_heads * d, arch.num_key_value_heads * d, \
        arch.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclass
class LoRAAdapter:
    """One adapter's matrices in float32 on the host, scale folded into B."""

    name: str
    int_id: int
    path: str
    rank: int  # the largest rank over its modules
    # (layer index, HF module name) -> (A [r, in], B [out, r] * scale)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = \
        field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.weights.values())


def _refuse(path: str, msg: str) -> InvalidParameterError:
    return InvalidParameterError(f"LoRA adapter {path!r}: {msg}", param="lora_path")


def _pattern_value(pattern: dict, layer: int, module: str, default):
    """PEFT's per-module override: a key matches a module whose full name ends with it."""
    full = f"model.layers.{layer}.{module}"
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?{key}$", full):
            return value
    return default


def read_adapter_config(path: str, lora: LoRAConfig) -> dict:
    """adapter_config.json after the checks that need no weights."""
    if not os.path.isdir(path):
        raise _refuse(path, "no such directory")
    cfg_file, w_file = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    for f in (cfg_file, w_file):
        if not os.path.isfile(f):
            raise _refuse(path, f"missing {os.path.basename(f)} (a PEFT adapter directory "
                          f"holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        with open(cfg_file) as fh:
            cfg = json.load(fh)
    except (OSError, ValueError) as e:
        raise _refuse(path, f"{CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise _refuse(path, f"{CONFIG_FILE} is not a JSON object")
    kind = str(cfg.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise _refuse(path, f"peft_type {kind} is not supported (only LORA)")
    if cfg.get("use_dora"):
        raise _refuse(path, "DoRA adapters (use_dora) are not supported")
    if cfg.get("fan_in_fan_out"):
        raise _refuse(path, "fan_in_fan_out adapters (Conv1D bases) are not supported")
    if cfg.get("bias", "none") not in ("none", None):
        raise _refuse(path, f"bias={cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise _refuse(path, f"modules_to_save {cfg['modules_to_save']} is not supported "
                      "(only LoRA on the decoder's linear layers)")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        bad = sorted(set(targets) - set(TARGETS))
        if bad:
            raise _refuse(path, f"target modules {bad} are not supported (supported: "
                          f"{', '.join(TARGETS)})")
    r = cfg.get("r", 8)
    if not isinstance(r, int) or r < 1:
        raise _refuse(path, f"r must be a positive integer, got {r!r}")
    return cfg


def load_adapter(path: str, name: str, int_id: int, arch: ModelArchConfig,
                 lora: LoRAConfig, *, weights: bool = True) -> LoRAAdapter:
    """Read and check an adapter; ``weights=False`` checks shapes from the file header
    only (what the API does before it registers one) and returns no matrices."""
    from safetensors import safe_open

    cfg = read_adapter_config(path, lora)
    shapes = module_shapes(arch)
    alpha, use_rs = cfg.get("lora_alpha", 8), bool(cfg.get("use_rslora", False))
    found: dict[tuple[int, str], dict[str, torch.Tensor | tuple]] = {}
    try:
        fh = safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt")
    except Exception as e:  # safetensors raises its own types for a corrupt header
        raise _refuse(path, f"{WEIGHTS_FILE} cannot be read ({e})") from None
    with fh:
        for key in fh.keys():
            m = _KEY.match(key)
            if m is None:
                raise _refuse(path, f"tensor {key!r} is not LoRA A/B of a supported "
                              f"decoder linear (supported: {', '.join(TARGETS)})")
            layer, module, ab = int(m.group(1)), m.group(3), m.group(4)
            if module not in TARGETS:
                raise _refuse(path, f"target module {module!r} ({key}) is not supported "
                              f"(supported: {', '.join(TARGETS)})")
            if layer >= arch.num_hidden_layers:
                raise _refuse(path, f"{key} names layer {layer} but the base model has "
                              f"{arch.num_hidden_layers}")
            t = fh.get_tensor(key) if weights else tuple(fh.get_slice(key).get_shape())
            found.setdefault((layer, module), {})[ab] = t
    if not found:
        raise _refuse(path, f"{WEIGHTS_FILE} holds no LoRA weights")
    out = LoRAAdapter(name, int_id, path, 0)
    for (layer, module), ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise _refuse(path, f"layer {layer} {module} has lora_{'A' if 'B' in ab else 'B'}"
                          " missing")
        a_shape = tuple(ab["A"].shape) if weights else ab["A"]
        b_shape = tuple(ab["B"].shape) if weights else ab["B"]
        fin, fout = shapes[module]
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != fin \
                or b_shape[0] != fout or a_shape[0] != b_shape[1]:
            raise _refuse(path, f"layer {layer} {module}: lora_A {list(a_shape)} and "
                          f"lora_B {list(b_shape)} do not fit the base layer "
                          f"({fin} in, {fout} out): an adapter of another base model?")
        r = a_shape[0]
        if r > lora.max_lora_rank:
            raise _refuse(path, f"rank {r} (layer {layer} {module}) is above "
                          f"--max-lora-rank {lora.max_lora_rank}")
        out.rank = max(out.rank, r)
        if weights:
            a_ = _pattern_value(cfg.get("alpha_pattern"), layer, module, alpha)
            scale = a_ / math.sqrt(r) if use_rs else a_ / r
            out.weights[(layer, module)] = (ab["A"].float().contiguous(),
                                            (ab["B"].float() * scale).contiguous())
    return out
