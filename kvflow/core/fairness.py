"""Fair sharing of a step between client requests (pure Python, no torch).

The unit is the client request: its ``n`` samples are one group (``Request.group_id``).
Two rules keep any one request from starving the others:

- **Seats**: a group holds at most ``max_seqs_per_request`` running seats at a time
  (default an eighth of ``max_num_seqs``, at least 16). Its other samples wait in the queue, and the
  scheduler admits later requests past them, so ``n=127`` can neither take every seat
  nor make every decode step 127 rows long while others wait behind it.
- **Prompt tokens**: while more than one group has prompt tokens to compute and together
  they want more than the step leaves for prompts after the running decodes, one group
  takes at most half of it (never less than ``MIN_SHARE``), or more where the others
  want less than their half. A huge prompt then cannot hold a small one back from its
  first token for its whole prefill, and prompts that fit together are not split. At most two prompts advance side by side;
  otherwise service stays first come, first served, which gives a burst of similar
  prompts the earliest first tokens on average (sharing among all of them, as
  processor sharing would, delays every one of them to near the end of the burst).

Decode tokens are not shared out: every running request decodes every step (a step's
time is bounded by the latency target or the token budget, not by leaving streams out).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from kvflow.core.request import Request

# The smallest prompt share worth a split: below it the other group is better served by
# waiting a step than by crumbs.
MIN_SHARE = 16
# How far into the waiting queue the scheduler looks for groups that want prompt tokens.
LOOKAHEAD = 8


def default_max_seqs_per_request(max_num_seqs: int) -> int:
    """Seats one client request's samples may hold when the operator sets no limit: an
    eighth of the seats, but at least 16 (16 decode rows are a step of about 50-90 ms for
    the embedded model on two cores, the smooth-streaming range)."""
    return max(max_num_seqs // 8, min(max_num_seqs, 16))


def owes_prompt(req: Request) -> bool:
    """Whether ``req`` owes more than its next decode token: its prompt (or, after a
    recompute preemption, its prompt and outputs so far). Drafts do not count."""
    return req.num_tokens_scheduled_for - req.num_computed_tokens > 1


class StepShares:
    """What one schedule() call hands each group: seats and prompt tokens."""

    def __init__(self, running: Iterable[Request], waiting: list[Request],
                 max_seqs_per_request: int) -> None:
        self.max_seats = max_seqs_per_request
        self.seats = Counter(r.group_id for r in running)
        # prompt tokens each group still wants (an upper bound: prefix-cache hits of
        # waiting requests are found at admission)
        self.demand: Counter[str] = Counter()
        for r in running:
            if owes_prompt(r):
                self.demand[r.group_id] += r.num_tokens_scheduled_for - r.num_computed_tokens
        for r in waiting[:LOOKAHEAD]:
            if self.seats[r.group_id] < self.max_seats:
                self.demand[r.group_id] += r.num_tokens_scheduled_for - r.num_computed_tokens
        self.num_prompt_groups = len(self.demand)
        self._budget: int | None = None  # set at the first prompt chunk of the step
        self._taken: Counter[str] = Counter()

    # --- seats ---------------------------------------------------------------
    def seat_free(self, req: Request) -> bool:
        return self.seats[req.group_id] < self.max_seats

    def took_seat(self, req: Request) -> None:
        self.seats[req.group_id] += 1

    # --- prompt tokens ---------------------------------------------------------
    def prompt_limit(self, req: Request, budget: int) -> int:
        """Most prompt tokens ``req``'s group may still take this step; ``budget`` is
        what the step has left (the first call fixes the share: decodes come first)."""
        if self._budget is None:
            self._budget = budget
        total, g = sum(self.demand.values()), req.group_id
        if self.num_prompt_groups <= 1 or total <= self._budget:
            share = self._budget
        else:
            others = total - self.demand[g]
            share = max(MIN_SHARE, -(-self._budget // 2), self._budget - others)
        return max(0, min(budget, share - self._taken[g]))

    def took_prompt(self, req: Request, n: int) -> None:
        self._taken[req.group_id] += n
