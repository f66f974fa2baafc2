"""How a model pools (``--runner``, ``--task``, ``--pooling-type``), read from the
checkpoint where it says so. Pure Python: ``kvflow.config`` holds a PoolerConfig.

Detection, first match wins:

- a sentence-transformers folder (``modules.json`` with a ``Pooling`` module): a pooling
  model; its ``1_Pooling/config.json`` gives the pooling mode and a ``Normalize`` module
  normalization;
- a folder or file name containing "reranker" (Qwen3-Reranker and its kind): a pooling
  model that scores with the "yes"/"no" logits of its last token;
- anything else generates, and still answers embeddings (last token, normalized) and
  cosine-similarity scores.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvflow.errors import InvalidParameterError, ModelLoadError, require
from kvflow.pooling.params import POOLING_TYPES, PoolingParams

if TYPE_CHECKING:
    from kvflow.config import EngineConfig

RUNNERS = ("auto", "generate", "pooling")
TASKS = ("embed", "score")
# sentence-transformers' Pooling config: older versions set one boolean key per mode,
# newer ones name it in "pooling_mode".
_ST_MODES = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
             ("pooling_mode_cls_token", "cls"))
_ST_MODE_NAMES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}


@dataclass(frozen=True)
class PoolerConfig:
    """What a model does with pooling requests."""

    runner: str = "generate"
    """generate: a text-generation model that also embeds; pooling: the model only
    pools (chat and completions are refused)."""
    task: str = "embed"
    """embed: scores are cosine similarities of pooled embeddings; score: the model is a
    cross-encoder reranker (query and document in one prompt, "yes"/"no" logits)."""
    pooling_type: str = "last"
    """last, mean or cls: the default of requests that do not say."""
    normalize: bool = True
    """Whether embeddings are L2-normalized by default."""
    source: str = "default"
    """Where these settings came from (for the start-up log)."""

    def __post_init__(self) -> None:
        require(self.runner in RUNNERS[1:], "runner", f"must be generate or pooling, got "
                f"{self.runner!r}")
        require(self.task in TASKS, "task", f"must be embed or score, got {self.task!r}")
        require(self.pooling_type in POOLING_TYPES, "pooling_type",
                f"must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")

    @property
    def is_reranker(self) -> bool:
        return self.runner == "pooling" and self.task == "score"

    def describe(self) -> str:
        if self.is_reranker:
            return f"pooling runner: cross-encoder reranker ({self.source})"
        what = "pooling runner" if self.runner == "pooling" else "generate runner"
        return (f"{what}: embeddings pool the {self.pooling_type} token"
                f"{'s' if self.pooling_type == 'mean' else ''}, "
                f"{'normalized' if self.normalize else 'not normalized'} ({self.source})")


def resolve_pooler_config(model: str, path: str | None, runner: str = "auto",
                          task: str | None = None, pooling_type: str = "auto"
                          ) -> PoolerConfig:
    """The PoolerConfig of a model from the user's options and its checkpoint folder."""
    require(runner in RUNNERS, "runner", f"must be one of {', '.join(RUNNERS)}, got "
            f"{runner!r}")
    require(task is None or task in TASKS, "task", f"must be embed or score, got {task!r}")
    require(pooling_type == "auto" or pooling_type in POOLING_TYPES, "pooling_type",
            f"must be auto or one of {', '.join(POOLING_TYPES)}, got {pooling_type!r}")
    found = _from_checkpoint(model, path)
    detected_runner, detected_task, mode, normalize, source = found
    if runner == "auto":
        runner = "pooling" if task is not None else detected_runner
    if task is None:
        task = detected_task if runner == "pooling" else "embed"
    if runner == "generate" and task == "score":
        raise InvalidParameterError("task score (a cross-encoder reranker) needs "
                                    "--runner pooling", param="task")
    if pooling_type != "auto":
        mode, source = pooling_type, "--pooling-type"
    return PoolerConfig(runner=runner, task=task, pooling_type=mode, normalize=normalize,
                        source=source)


def _from_checkpoint(model: str, path: str | None) -> tuple[str, str, str, bool, str]:
    """(runner, task, pooling type, normalize, source) the checkpoint asks for."""
    folder = path if path and os.path.isdir(path) else None
    if folder is not None and os.path.isfile(os.path.join(folder, "modules.json")):
        return _sentence_transformers(folder)
    names = " ".join(x for x in (model, path or "") if x).lower()
    if "reranker" in names:
        return "pooling", "score", "last", False, "a reranker by its name"
    return "generate", "embed", "last", True, "default"


def _sentence_transformers(folder: str) -> tuple[str, str, str, bool, str]:
    where = os.path.join(folder, "modules.json")
    try:
        with open(where) as f:
            modules = json.load(f)
        kinds = [(m.get("type", ""), m.get("path", "")) for m in modules]
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise ModelLoadError(f"{where}: not a sentence-transformers module list ({e})")
    mode = "last"
    for kind, sub in kinds:
        if kind.endswith("Pooling"):
            cfg_path = os.path.join(folder, sub, "config.json")
            try:
                with open(cfg_path) as f:
                    cfg = json.load(f)
            except (OSError, ValueError) as e:
                raise ModelLoadError(f"{cfg_path}: cannot read the pooling config ({e})")
            modes = [name for key, name in _ST_MODES if cfg.get(key)]
            named = cfg.get("pooling_mode")
            if isinstance(named, str) and named in _ST_MODE_NAMES:
                modes.insert(0, _ST_MODE_NAMES[named])
            if not modes:
                raise ModelLoadError(f"{cfg_path}: none of the pooling modes kvflow runs "
                                     "(last token, mean, CLS) is on")
            mode = modes[0]
    normalize = any(kind.endswith("Normalize") for kind, _ in kinds)
    return "pooling", "embed", mode, normalize, "sentence-transformers modules.json"


def check_pooling_engine(params: PoolingParams, config: "EngineConfig") -> None:
    """Refuse pooling requests this engine cannot run (the engine core's own check)."""
    params.check_for_model(config.model.arch.hidden_size, config.model.arch.vocab_size)
    if config.speculative is not None:
        raise InvalidParameterError("pooling requests cannot run with speculative "
                                    "decoding on; start the server without it",
                                    param="input")
    if config.parallel.pipeline_parallel_size > 1:
        raise InvalidParameterError("pooling requests cannot run with pipeline "
                                    "parallelism yet", param="input")
