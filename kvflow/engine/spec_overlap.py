"""When a speculative engine with overlapped steps waits for the step in flight.

Overlapped (async) scheduling builds and launches step N+1 before step N's tokens reach
the host; that hides the host's scheduling and input building behind the GPU, which is
most of the gap between two CUDA-graph decode steps. Speculation needs the opposite:
drafts are proposed from a request's known tokens, so step N+1 can only verify drafts if
step N was collected first (a proposal made while a token is still in flight would sit
at the wrong positions). And a step that verified drafts must be collected before the
next one is built, since how many tokens it keeps is only known then.

``SpecOverlap`` decides per step. It collects first (no overlap) while drafts are coming:
after a verification step and after any collected step that proposed drafts. While no
request drafts (speculation switched off by batch size, or a proposer that finds
nothing, as n-gram lookup in free chat) steps overlap like plain decoding, and only
every ``interval``-th step collects first to give the proposer fresh tokens; the
interval doubles after each such probe that proposes nothing (up to ``max_interval``)
and drops back to 1 as soon as one does. So a step without drafts costs about what a
plain step costs, and drafting resumes within ``max_interval`` steps of becoming
possible.
"""

from __future__ import annotations


class SpecOverlap:
    def __init__(self, disable_by_batch_size: int | None, max_interval: int = 16) -> None:
        self.limit = disable_by_batch_size
        self.max_interval = max_interval
        self.interval = 1  # collect first every `interval` steps while nobody drafts
        self.since = 0  # overlapped steps since the last probe
        self.probing = False  # the last decision was a probe (its result is telling)

    def collect_first(self, in_flight_verifies: bool, num_running: int) -> bool:
        """Whether the step in flight must be collected before the next is scheduled.
        ``in_flight_verifies``: it verifies drafts; ``num_running``: requests running."""
        self.probing = False
        if in_flight_verifies:
            self.probing = True
            return True
        if self.limit is not None and num_running > self.limit:
            return False  # no proposals at this batch size: overlap like plain decoding
        self.since += 1
        if self.since >= self.interval:
            self.since = 0
            self.probing = True
            return True
        return False

    def observe(self, drafted: bool) -> None:
        """After a collect-first step: did its result propose any drafts?"""
        if not self.probing:
            return
        self.interval = 1 if drafted else min(self.interval * 2, self.max_interval)
