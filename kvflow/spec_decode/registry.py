"""The proposer registry: ``speculative_config.method`` -> its proposer (each in its own
module, importing only the ``Proposer`` base of ``proposer.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from kvflow.config import EngineConfig, SpeculativeConfig


def make_proposer(spec: "SpeculativeConfig", engine: "EngineConfig | None" = None,
                  device=None, backend=None, kernels: bool = False, target=None,
                  dtype=None) -> Proposer:
    """The proposer of ``spec.method``; a draft model needs the engine config (its
    resolved draft), the device and the attention backend to load and run it; Medusa
    heads need the target model (its lm_head) and dtype."""
    if spec.method == "ngram":
        from kvflow.spec_decode.ngram import NgramProposer

        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                             spec.prompt_lookup_max)
    if spec.method == "draft_model":
        from kvflow.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(engine, device, backend, kernels)
    if spec.method == "medusa":
        from kvflow.spec_decode.medusa import MedusaProposer

        return MedusaProposer(spec.model, spec.num_speculative_tokens, target, dtype, device,
                              spec.medusa_tree)
    if spec.method == "eagle_mlp":
        from kvflow.spec_decode.eagle_mlp import EagleMlpProposer

        return EagleMlpProposer(spec.model, spec.num_speculative_tokens, target, dtype, device,
                                spec.draft_confidence)
    raise ValueError(f"unknown speculative method {spec.method!r}")  # config validated it
