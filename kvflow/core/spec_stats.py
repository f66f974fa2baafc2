"""Counters of speculative decoding (pure Python): how many draft tokens were verified and
how many of them the target kept, overall and per draft position, and where the time went
(proposing drafts, verification steps)."""

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
    # Time, measured by the worker: proposer runs (each drafts for the whole batch) and
    # verification steps (steps with draft tokens, from launch until their tokens reach the
    # host: forward, rejection sampling and any host work that overlapped them).
    num_proposals: int = 0
    draft_time_s: float = 0.0
    num_verify_steps: int = 0
    verify_time_s: float = 0.0

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

    def observe_times(self, draft_s: float | None, verify_s: float | None) -> None:
        """One step's timings from its ModelRunnerOutput (None: no proposer ran / the step
        verified no drafts)."""
        if draft_s is not None:
            self.num_proposals += 1
            self.draft_time_s += draft_s
        if verify_s is not None:
            self.num_verify_steps += 1
            self.verify_time_s += verify_s

    @property
    def mean_draft_ms(self) -> float:
        """Mean time of one proposer run (drafts for every request of the batch)."""
        return 1000 * self.draft_time_s / self.num_proposals if self.num_proposals else 0.0

    @property
    def mean_verify_ms(self) -> float:
        """Mean time of one verification step."""
        return 1000 * self.verify_time_s / self.num_verify_steps if self.num_verify_steps \
            else 0.0

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
                                 list(self.drafted_per_position), self.num_proposals,
                                 self.draft_time_s, self.num_verify_steps, self.verify_time_s)

    def since(self, before: "SpecDecodingStats") -> "SpecDecodingStats":
        """What was counted after ``before`` (an earlier copy of these counters)."""
        pad = lambda xs: xs + [0] * (len(self.drafted_per_position) - len(xs))  # noqa: E731
        return SpecDecodingStats(
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            [a - b for a, b in zip(self.accepted_per_position,
                                   pad(before.accepted_per_position))],
            [a - b for a, b in zip(self.drafted_per_position,
                                   pad(before.drafted_per_position))],
            self.num_proposals - before.num_proposals,
            self.draft_time_s - before.draft_time_s,
            self.num_verify_steps - before.num_verify_steps,
            self.verify_time_s - before.verify_time_s)
