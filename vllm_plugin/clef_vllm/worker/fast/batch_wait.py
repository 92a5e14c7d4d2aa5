"""Rule 5 of :class:`clef_vllm.worker.scheduler.ClefScheduler`: when an idle engine holds new requests back to
batch them (``--batch-wait-ms``). Kept apart from vLLM so that the scheduler and the stepped stand-in engine of
``bench/instant_server.py`` decide with the same code.

Hold while nothing runs, fewer requests wait than half the largest step of the last second
(:data:`PEAK_WINDOW_S`), and the oldest of them has waited less than the limit. One request at a time (a
largest step of 1) never waits, a running request is never held back, and no request waits longer than
the limit for it.
"""

from __future__ import annotations

from collections import deque

#: how far back the largest step sets how many waiting requests make a batch worth starting
PEAK_WINDOW_S = 1.0


class BatchWait:
    """The hold decision and what it remembers: the sizes of the last second's steps."""

    def __init__(self, wait_s: float):
        self.wait_s = float(wait_s)
        self.steps: deque[tuple[float, int]] = deque()     # (when, requests) of recent working steps
        self.held_steps = 0                                 # steps that held new requests back

    @property
    def on(self) -> bool:
        return self.wait_s > 0

    def stepped(self, now: float, requests: int) -> None:
        """A step scheduled ``requests`` requests."""
        if requests and self.on:
            self.forget(now)
            self.steps.append((now, requests))

    def forget(self, now: float) -> None:
        while self.steps and now - self.steps[0][0] > PEAK_WINDOW_S:
            self.steps.popleft()

    def hold(self, now: float, *, running: int, waiting: int, oldest: float) -> bool:
        """Whether this step leaves the ``waiting`` requests waiting (counted in :attr:`held_steps`);
        ``oldest``: when the oldest of them arrived."""
        if not self.on or running or not waiting:
            return False
        self.forget(now)
        peak = max((n for _, n in self.steps), default=0)
        held = waiting < (peak + 1) // 2 and now - oldest < self.wait_s
        self.held_steps += held
        return held
