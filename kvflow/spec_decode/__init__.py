"""Speculative decoding: proposers of draft tokens. The worker calls them after each step;
the scheduler only sees the tokens they propose (docs/speculative.md)."""

from kvflow.spec_decode.proposer import Proposer
from kvflow.spec_decode.registry import make_proposer

__all__ = ["Proposer", "make_proposer"]
