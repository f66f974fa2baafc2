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
