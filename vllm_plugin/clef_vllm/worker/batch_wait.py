"""Rule 5 of :class:`clef_vllm.worker.scheduler.ClefScheduler`: when an idle engine holds new requests back to
batch them. Kept apart from vLLM so that the scheduler and a simulation of closed-loop clients
(``bench/batch_wait_sim.py``) decide with the same code.

Two ways to decide (``--batch-wait-mode``):

* ``half`` (the default): hold while fewer requests wait than half the largest step of the last
  second (:data:`PEAK_WINDOW_S`) and the oldest of them has waited less than the limit. One request at a
  time (a largest step of 1) never waits.
* ``refill``: hold while fewer requests have arrived since the engine went idle than its last step
  answered (closed-loop clients send their next request after an answer), the waiting prompts leave room
  in the step's token budget for one more of their mean size, and the engine has been idle for less than
  the limit (counted from the later of the moment it went idle and the oldest waiting request's arrival).
  A request that arrives while nothing was answered, or once every answered client is back, never waits.

Both hold only while nothing runs: a running request is never held back, and the GPU idles for at most the
limit per step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from clef_vllm.contract import BATCH_WAIT_MODES

#: ``half``: how far back the largest step sets how many waiting requests make a batch worth starting
PEAK_WINDOW_S = 1.0


class BatchWait:
    """The hold decision and what it remembers: recent steps' sizes, when the engine last went idle, how many
    requests its last step answered and how many have arrived since."""

    def __init__(self, wait_s: float, mode: str = BATCH_WAIT_MODES[0]):
        if mode not in BATCH_WAIT_MODES:
            raise ValueError(f"batch wait mode {mode!r}: one of {', '.join(BATCH_WAIT_MODES)}")
        self.wait_s, self.mode = float(wait_s), mode
        self.steps: deque[tuple[float, int]] = deque()     # (when, requests) of recent working steps
        self.idle_since: float | None = None               # when the last step's output left nothing running
        self.answered = 0                                   # requests that step finished
        self.arrived = 0                                    # requests added since
        self.held_steps = 0                                 # steps that held new requests back

    @property
    def on(self) -> bool:
        return self.wait_s > 0

    def arrival(self) -> None:
        """A request reached the scheduler."""
        self.arrived += 1

    def stepped(self, now: float, requests: int) -> None:
        """A step scheduled ``requests`` requests (``half`` keeps the sizes of the last second)."""
        if requests:
            self.forget(now)
            self.steps.append((now, requests))

    def finished(self, now: float, answered: int, running: int) -> None:
        """A step's output came back: it finished ``answered`` requests and left ``running`` unfinished."""
        if not running:
            self.idle_since, self.answered, self.arrived = now, answered, 0

    def forget(self, now: float) -> None:
        while self.steps and now - self.steps[0][0] > PEAK_WINDOW_S:
            self.steps.popleft()

    def hold(self, now: float, *, running: int, waiting: int, oldest: float,
             waiting_tokens: Callable[[], int], budget: int) -> bool:
        """Whether this step leaves the ``waiting`` requests waiting (counted in :attr:`held_steps`).
        ``oldest``: the oldest waiting request's arrival; ``waiting_tokens()``: their prompt tokens still to
        run, asked only when it decides; ``budget``: the step's token budget."""
        if not self.on or running or not waiting:
            return False
        if self.mode == "half":
            self.forget(now)
            peak = max((n for _, n in self.steps), default=0)
            held = waiting < (peak + 1) // 2 and now - oldest < self.wait_s
        else:
            since = oldest if self.idle_since is None else max(self.idle_since, oldest)
            held = self.arrived < self.answered and now - since < self.wait_s
            if held:
                tokens = waiting_tokens()
                held = tokens + tokens / waiting <= budget      # room for one more prompt of their mean size
        self.held_steps += held
        return held
