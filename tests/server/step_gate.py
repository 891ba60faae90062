"""A gate the test controls in front of a real server engine's ``step``: it holds time, nothing else.

A test that needs "a call still in flight when the update arrives" must not get it from a token
count or a sleep (a faster or an idle machine finishes the call first). :class:`StepGate` wraps
one engine's ``step`` (the real one still runs every step it lets through) so the engine thread
waits at the gate until the test lets a given number of steps pass. While the thread waits there
the call cannot finish, whatever the machine's speed, and the test knows exactly how many steps
(decoded tokens) ran.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

# A test lets steps through within milliseconds; this only turns a forgotten release into an error.
HOLD_LIMIT_S = 60.0


class StepGate:
    """``with StepGate(engine) as gate:``: ``gate.allow(n)`` lets ``n`` more steps pass,
    ``gate.wait_held()`` waits until the engine thread waits at the gate (every allowed step ran),
    ``gate.open()`` lets everything pass. Closed (no step passes) when entered."""

    def __init__(self, engine: Any):
        self._engine = engine
        self._real_step: Callable[[], Any] = engine.step
        self._cond = threading.Condition()
        self._allowed: int | None = 0  # ``None``: open
        self._waiting = False
        self.passed = 0  # steps let through so far

    def __enter__(self) -> StepGate:
        self._engine.step = self._gated_step  # an instance attribute: the class's step stays as it is
        return self

    def __exit__(self, *exc: object) -> None:
        self.open()
        del self._engine.step

    # --------------------------------------------------------------------------- the test's side
    def allow(self, steps: int) -> None:
        with self._cond:
            self._allowed = (self._allowed or 0) + steps
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._allowed = None
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._allowed = 0

    def wait_held(self, timeout_s: float = HOLD_LIMIT_S) -> None:
        """Until every allowed step ran and the engine thread waits at the gate for the next one."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not (self._waiting and self._allowed == 0):
                left = deadline - time.monotonic()
                assert left > 0, (
                    f"the engine thread did not reach the step gate within {timeout_s:g}s "
                    f"({self.passed} steps passed; did the call finish or fail early?)"
                )
                self._cond.wait(left)

    # ------------------------------------------------------------------------- the engine's side
    def _gated_step(self) -> Any:
        deadline = time.monotonic() + HOLD_LIMIT_S
        with self._cond:
            while self._allowed == 0:
                self._waiting = True
                self._cond.notify_all()
                left = deadline - time.monotonic()
                if left <= 0:
                    self._waiting = False
                    raise RuntimeError(f"step gate: held for {HOLD_LIMIT_S:g}s, the test never released it")
                self._cond.wait(left)
            self._waiting = False
            if self._allowed is not None:
                self._allowed -= 1
            self.passed += 1
        return self._real_step()
