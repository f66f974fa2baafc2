"""Which waiting requests' LoRA adapters may start (pure Python, no torch).

The worker holds ``max_loras`` adapters on the device at once, so the running requests
may use at most that many distinct adapters (the base model needs no slot). A waiting
request whose adapter is neither running nor has a free slot cannot start now.

Stopping admission there (first come, first served to the letter) starves the step:
with requests spread round-robin over 16 adapters and 4 slots, the fifth request blocks
everything behind it until one of the first four finishes, and the engine runs four
streams at a time (measured on an H100 at 8B shape: 0.07x the base model's throughput,
a swap every step). So a request blocked on its adapter is passed over, keeping its
place, and later requests whose adapter is already running (or the base model) start.

Passing over alone can starve the blocked request: while every running adapter keeps
getting new requests, no slot ever frees. So the first time a request is passed over,
one running adapter is chosen to **drain**: the one with the fewest running requests
(the soonest to free its slot). Its waiting requests are passed over too until it has
no running request left; the freed slot then goes to the oldest blocked request, which
is first in the queue's order. A blocked request therefore waits at most for the
requests of one adapter to finish, whatever keeps arriving.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from kvflow.core.request import Request

# Requests passed over in one step before admission stops (a long queue of blocked
# requests would otherwise be walked every step).
MAX_PASSED_OVER = 256


class AdapterSeats:
    """One step's admission rule for adapters; ``draining`` persists between steps
    (``Scheduler.lora_draining``)."""

    def __init__(self, running: Iterable[Request], max_loras: int,
                 draining: int | None) -> None:
        self.max_loras = max_loras
        self.counts: Counter[int] = Counter(
            r.lora_request.lora_int_id for r in running if r.lora_request is not None)
        # the adapter being drained, while it still has running requests
        self.draining = draining if draining in self.counts else None
        self.passed_over = 0

    def may_start(self, req: Request) -> bool:
        """Whether ``req``'s adapter lets it start in this step; False: pass it over
        (its place in the queue is kept)."""
        lora = req.lora_request
        if lora is None:
            return True
        aid = lora.lora_int_id
        if aid == self.draining:
            self.passed_over += 1
            return False
        if aid in self.counts or len(self.counts) < self.max_loras:
            return True
        if self.draining is None:  # the first blocked request: free a slot for it
            self.draining = min(self.counts, key=lambda a: (self.counts[a], a))
        self.passed_over += 1
        return False

    @property
    def stop(self) -> bool:
        """Enough of the queue walked for this step."""
        return self.passed_over >= MAX_PASSED_OVER

    def started(self, req: Request) -> None:
        if req.lora_request is not None:
            self.counts[req.lora_request.lora_int_id] += 1
