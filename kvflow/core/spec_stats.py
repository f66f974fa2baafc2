"""Counters of speculative decoding (pure Python): how many draft tokens were verified and
how many of them the target kept, overall and per draft position."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Cumulative since start; the engine's log and /metrics read deltas of these."""

    num_drafts: int = 0  # verification steps of one request (each with >= 1 draft token)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_position[j]: verifications that kept draft j (so also drafts 0..j-1).
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        while len(self.drafted_per_position) < num_draft_tokens:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for j in range(num_draft_tokens):
            self.drafted_per_position[j] += 1
            if j < num_accepted:
                self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Kept draft tokens over verified draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step yields on average: kept drafts plus the one sampled
        after them (1.0 means speculation gained nothing)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def position_acceptance(self) -> list[float]:
        """Per draft position: how often it was kept when it was proposed."""
        return [a / d if d else 0.0
                for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def copy(self) -> "SpecDecodingStats":
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens,
                                 self.num_accepted_tokens, list(self.accepted_per_position),
                                 list(self.drafted_per_position))
