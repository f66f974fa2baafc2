"""Latency-target batching (``--target-tpot-ms``): a step-time model the scheduler learns
online, and the per-step caps it implies (pure Python, no torch).

A step's time is modelled as ``a + b * tokens + c * seqs``: a fixed part (reading the
weights, launching the step), a part per token the step computes (the matmuls) and a part
per sequence (its logits row, sampling, bookkeeping). The coefficients start at a prior
(the capacity planner's figures on a GPU, rough host rates on CPU) and follow the step
times measured since: an exponentially weighted least-squares fit pulled towards the
prior, so directions the workload never varies (decode-only traffic has tokens == seqs)
stay at the prior instead of drifting. Every step that decodes is one token of TPOT for
each running request, so keeping the predicted step time under the target keeps TPOT
under it; requests the target has no room for wait in the queue.

An optional TTFT target (``--target-ttft-ms``) sits on top: when the request at the head
of the queue would miss its time to first token at the TPOT caps (too few seats, or
prefill chunks too small), and can still make it, that step admits it and grows the
budget by the chunk it needs; the step runs over the TPOT plan once so that one request
meets its first-token deadline. A request that has already missed it waits its turn: saving it would
cost everyone's TPOT and still miss.

Smooth steps (``--target-step-ms``, opt-in: docs/serving.md says when they pay) use the same
model to bound the step instead of the TPOT: only the token budget is capped, never the
running batch (every running request decodes every step, so throughput keeps the batch's
economies), and the budget always leaves a minimum prompt chunk beside the decodes. A
model that a loaded machine has taught that every step is over the target therefore
slows prefill to that chunk per step instead of stopping it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# Plan for this fraction of the target: step times scatter around the prediction.
HEADROOM = 0.9
# Weight of past observations after each new one (about 50 steps of memory).
FORGET = 0.98
# How many observations' worth of belief the prior carries.
PRIOR_WEIGHT = 0.25
# Smooth steps: prompt tokens a step may always compute beside the running decodes.
# Below 32 rows the C++ CPU step gains little from batching prompt rows (a 16-token chunk
# cost about as much as a 32-token one on the 2-core machine), so smaller chunks would
# mostly add steps.
MIN_PROMPT_CHUNK = 32


@dataclass(frozen=True)
class StepTimePrior:
    """Initial step-time coefficients in seconds: ``fixed + per_token * tokens +
    per_seq * seqs``, and where they came from."""

    fixed_s: float
    per_token_s: float
    per_seq_s: float
    source: str = "given"

    def __post_init__(self) -> None:
        for name in ("fixed_s", "per_token_s", "per_seq_s"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


def _solve3(m: list[list[float]], v: list[float]) -> list[float]:
    """Solve a 3x3 system (Gaussian elimination with partial pivoting)."""
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(3):
        piv = max(range(col, 3), key=lambda r: abs(a[r][col]))
        a[col], a[piv] = a[piv], a[col]
        for r in range(col + 1, 3):
            f = a[r][col] / a[col][col]
            for k in range(col, 4):
                a[r][k] -= f * a[col][k]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (a[r][3] - sum(a[r][k] * x[k] for k in range(r + 1, 3))) / a[r][r]
    return x


class StepTimeModel:
    """Predicts a step's seconds from its token and sequence counts; learns online."""

    def __init__(self, prior: StepTimePrior, forget: float = FORGET,
                 prior_weight: float = PRIOR_WEIGHT) -> None:
        self.prior = prior
        self.forget = forget
        self.theta0 = [prior.fixed_s, prior.per_token_s, prior.per_seq_s]
        # Ridge strength per coefficient: prior_weight observations of a small step
        # (16 tokens, 4 sequences), so each term is pulled towards its prior in its own
        # units, firmly only where the measured steps say nothing.
        scales = [1.0, 16.0, 4.0]
        self.ridge = [prior_weight * s * s for s in scales]
        self.xx = [[0.0] * 3 for _ in range(3)]  # decayed sum of x x^T
        self.xy = [0.0] * 3  # decayed sum of x y
        self.num_observed = 0
        self.theta = list(self.theta0)

    def predict(self, tokens: int, seqs: int) -> float:
        a, b, c = self.theta
        return a + b * tokens + c * seqs

    def observe(self, tokens: int, seqs: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0.0:
            return
        x = (1.0, float(tokens), float(seqs))
        f = self.forget
        for i in range(3):
            self.xy[i] = f * self.xy[i] + x[i] * seconds
            for j in range(3):
                self.xx[i][j] = f * self.xx[i][j] + x[i] * x[j]
        self.num_observed += 1
        m = [[self.xx[i][j] + (self.ridge[i] if i == j else 0.0) for j in range(3)]
             for i in range(3)]
        v = [self.xy[i] + self.ridge[i] * self.theta0[i] for i in range(3)]
        try:
            theta = _solve3(m, v)
        except ZeroDivisionError:
            return
        # Costs are never negative; a negative slope is noise the fit picked up.
        self.theta = [max(0.0, t) for t in theta]

    def max_tokens(self, seqs: int, target_s: float) -> int:
        """Most tokens a step of ``seqs`` sequences may compute within ``target_s``."""
        a, b, c = self.theta
        room = target_s - a - c * seqs
        if room <= 0.0:
            return 0
        return int(room / b) if b > 0.0 else 1 << 30

    def max_seqs(self, target_s: float) -> int:
        """Most sequences a decode-only step (one token each) may hold within target_s."""
        a, b, c = self.theta
        room = target_s - a
        if room <= 0.0:
            return 0
        return int(room / (b + c)) if b + c > 0.0 else 1 << 30


class LatencyTarget:
    """Per-step caps that keep each step within the TPOT target, and the online
    measurement of step times (interval between consecutive schedule() calls while the
    same requests keep running)."""

    def __init__(self, target_tpot_s: float, model: StepTimeModel,
                 clock: Callable[[], float], target_ttft_s: float | None = None,
                 cap_seats: bool = True, min_chunk: int = 0) -> None:
        self.target_s = target_tpot_s
        self.target_ttft_s = target_ttft_s
        # Smooth steps (--target-step-ms): cap_seats False, min_chunk MIN_PROMPT_CHUNK.
        self.cap_seats = cap_seats
        self.min_chunk = min_chunk
        self.model = model
        self.clock = clock
        self._last: tuple[float, int, int, frozenset[str]] | None = None
        self.num_capped_steps = 0  # steps whose budget or seats the target lowered
        self.num_ttft_steps = 0  # steps that went over the TPOT plan to save a TTFT

    def caps(self, num_running: int, budget: int, max_seqs: int) -> tuple[int, int]:
        """(token budget, seat limit) for the next step."""
        plan = self.target_s * HEADROOM
        seats = max(1, min(max_seqs, self.model.max_seqs(plan))) if self.cap_seats \
            else max_seqs
        # Room for every running request's decode token and one more sequence joining;
        # never less than the running decodes, which would stall requests mid-answer,
        # plus the minimum prompt chunk (smooth steps), so prefill never stops.
        tokens = self.model.max_tokens(min(num_running + 1, seats), plan)
        new_budget = max(1, min(budget, max(tokens, num_running + self.min_chunk)))
        if new_budget < budget or seats < max_seqs:
            self.num_capped_steps += 1
        return new_budget, seats

    def ttft_budget(self, arrival_time: float, prompt_left: int, num_running: int,
                    tpot_budget: int, max_budget: int) -> int | None:
        """The token budget a step needs so that the head-of-queue request (arrived at
        ``arrival_time``, ``prompt_left`` prompt tokens to compute) meets the TTFT target;
        None when it meets it at the TPOT caps, when there is no TTFT target, or when it
        can no longer meet it (it has waited past the target, or even the engine's whole
        budget would not finish its prompt in time)."""
        if self.target_ttft_s is None or prompt_left <= 0:
            return None
        plan = self.target_ttft_s * HEADROOM
        waited = self.clock() - arrival_time
        step_s = max(self.model.predict(tpot_budget, num_running + 1), 1e-6)
        share = max(1, tpot_budget - num_running)  # what the running decodes leave it
        if waited + -(-prompt_left // share) * step_s <= plan:
            return None  # on time at the TPOT caps (once it has a seat)
        steps_left = int((plan - waited) / step_s)
        if steps_left < 1:
            return None  # too late already
        need = num_running + -(-prompt_left // steps_left)
        if need > max_budget:
            return None
        self.num_ttft_steps += 1
        return max(tpot_budget, need)

    def on_schedule(self, tokens: int, seqs: int, req_ids: frozenset[str],
                    alive: Callable[[str], bool]) -> None:
        """Called once per schedule() with what it scheduled. The time since the last
        call is that step's duration, provided the engine had work all along (one of the
        last step's requests is still alive: it never sat idle waiting for requests)."""
        now = self.clock()
        last = self._last
        if last is not None and last[1] > 0 and any(alive(r) for r in last[3]):
            self.model.observe(last[1], last[2], now - last[0])
        self._last = (now, tokens, seqs, req_ids)
