"""The config of a Medusa heads checkpoint, read and checked at startup (torch-free, so
EngineArgs refuses heads made for another model before anything loads)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from kvflow.errors import InvalidParameterError, ModelLoadError, ModelNotFoundError

HEADS_FILE = "medusa_lm_head.safetensors"


@dataclass(frozen=True)
class MedusaHeadsConfig:
    num_heads: int
    num_layers: int
    hidden_size: int | None  # None: not recorded (public checkpoints); read off the weights
    vocab_size: int | None
    shared_lm_head: bool

    @classmethod
    def read(cls, path: str) -> "MedusaHeadsConfig":
        """The heads' config.json (torch-free: EngineArgs checks it at startup)."""
        where = "speculative_config.model"
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isdir(path) or not os.path.isfile(cfg_path):
            raise ModelNotFoundError(f"{where}: {path!r} is not a directory with a Medusa "
                                     "config.json (and medusa_lm_head.safetensors)",
                                     param=where)
        if not os.path.isfile(os.path.join(path, HEADS_FILE)):
            raise ModelNotFoundError(f"{where}: {path!r} has no {HEADS_FILE}", param=where)
        try:
            with open(cfg_path, encoding="utf-8") as f:
                raw = json.load(f)
            return cls(num_heads=int(raw["medusa_num_heads"]),
                       num_layers=int(raw.get("medusa_num_layers", 1)),
                       hidden_size=raw.get("hidden_size"), vocab_size=raw.get("vocab_size"),
                       shared_lm_head=bool(raw.get("shared_lm_head", False)))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{where}: cannot read {cfg_path}: {e!r}",
                                 param=where) from None

    @staticmethod
    def read_report(path: str) -> dict | None:
        """The training report ``kvflow train-medusa`` stores in config.json (held-out
        accuracies per head), or None."""
        try:
            with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, ValueError):
            return None
        report = raw.get("kvflow_train_medusa") if isinstance(raw, dict) else None
        return report if isinstance(report, dict) else None

    def check(self, hidden_size: int, vocab_size: int, k: int) -> None:
        """Refuse heads made for another model, or fewer heads than drafts asked for."""
        where = "speculative_config.model"
        if self.hidden_size is not None and self.hidden_size != hidden_size:
            raise InvalidParameterError(
                f"{where}: the Medusa heads are for hidden size {self.hidden_size} but the "
                f"target's is {hidden_size}", param=where)
        if self.vocab_size is not None and self.vocab_size != vocab_size:
            raise InvalidParameterError(
                f"{where}: the Medusa heads are for a vocabulary of {self.vocab_size} but the "
                f"target's is {vocab_size}", param=where)
        if k > self.num_heads:
            raise InvalidParameterError(
                f"speculative_config.num_speculative_tokens is {k} but the Medusa checkpoint "
                f"has {self.num_heads} heads (one draft per head)",
                param="speculative_config.num_speculative_tokens")


EAGLE_MLP_FILE = "eagle_mlp.safetensors"
EAGLE_MLP_KIND = "eagle_mlp"


@dataclass(frozen=True)
class EagleMlpConfig:
    """An ``eagle_mlp`` draft head's config.json (spec_decode/eagle_mlp.py)."""

    hidden_size: int
    """The target's hidden size (the head reads and predicts its final features)."""
    vocab_size: int
    """The target's vocabulary (the draft vocabulary's ids index it)."""
    draft_vocab_size: int
    """Tokens the head can propose: the most frequent answer tokens of its training text."""
    intermediate_size: int
    """Width of the head's gated MLP."""
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "draft_vocab_size", "intermediate_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} exceeds vocab_size "
                             f"{self.vocab_size}")

    def to_json(self) -> dict:
        return {"kvflow_draft_head": EAGLE_MLP_KIND, "hidden_size": self.hidden_size,
                "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
                "intermediate_size": self.intermediate_size, "rms_norm_eps": self.rms_norm_eps}

    @classmethod
    def read(cls, path: str) -> "EagleMlpConfig":
        """The head's config.json (torch-free: EngineArgs checks it at startup)."""
        where = "speculative_config.model"
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isdir(path) or not os.path.isfile(cfg_path):
            raise ModelNotFoundError(f"{where}: {path!r} is not a directory with an eagle_mlp "
                                     f"config.json (and {EAGLE_MLP_FILE})", param=where)
        if not os.path.isfile(os.path.join(path, EAGLE_MLP_FILE)):
            raise ModelNotFoundError(f"{where}: {path!r} has no {EAGLE_MLP_FILE}", param=where)
        try:
            with open(cfg_path, encoding="utf-8") as f:
                raw = json.load(f)
            if raw.get("kvflow_draft_head") != EAGLE_MLP_KIND:
                raise ValueError(f"kvflow_draft_head is {raw.get('kvflow_draft_head')!r}, "
                                 f"not {EAGLE_MLP_KIND!r}")
            return cls(hidden_size=raw["hidden_size"], vocab_size=raw["vocab_size"],
                       draft_vocab_size=raw["draft_vocab_size"],
                       intermediate_size=raw["intermediate_size"],
                       rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{where}: cannot read {cfg_path} as an eagle_mlp head: {e}",
                                 param=where) from None

    def check(self, hidden_size: int, vocab_size: int) -> None:
        """Refuse a head made for another model."""
        where = "speculative_config.model"
        if self.hidden_size != hidden_size:
            raise InvalidParameterError(
                f"{where}: the eagle_mlp head is for hidden size {self.hidden_size} but the "
                f"target's is {hidden_size}", param=where)
        if self.vocab_size != vocab_size:
            raise InvalidParameterError(
                f"{where}: the eagle_mlp head is for a vocabulary of {self.vocab_size} but "
                f"the target's is {vocab_size}", param=where)
