"""Measures how long the GPU sits idle between engine steps (CUDA events).

The GPU processes events in stream order, so the time between the event after step N's
last kernel and the event before step N+1's first one is the gap the CPU left open.
"""

from __future__ import annotations

import torch


class GpuIdleMeter:
    def __init__(self) -> None:
        self.marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._start: torch.cuda.Event | None = None

    def step_start(self) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()

    def step_end(self) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.marks.append((self._start, end))

    def report(self) -> dict:
        """Busy and idle milliseconds over the recorded steps (synchronizes)."""
        torch.cuda.synchronize()
        busy = sum(s.elapsed_time(e) for s, e in self.marks)
        gaps = [self.marks[i][1].elapsed_time(self.marks[i + 1][0])
                for i in range(len(self.marks) - 1)]
        idle = sum(gaps)
        return {"steps": len(self.marks), "busy_ms": busy, "idle_ms": idle,
                "idle_ms_per_step": idle / max(1, len(gaps)),
                "idle_fraction": idle / max(1e-9, busy + idle)}
