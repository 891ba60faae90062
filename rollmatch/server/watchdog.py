"""The engine lock with a watchdog: who holds the engine, since when, and when it last made progress.

Owns: :class:`EngineGuard`. Generation and weight loads take the engine one at a time through
:meth:`EngineGuard.hold`; engines call :meth:`EngineGuard.progress` on every decoding step (a vLLM
engine step, an HF forward). A generation that makes no progress for ``stall_timeout_s`` is a
*stalled* engine: ``/health/`` answers 503 naming it, and requests waiting for the engine give up
with a 503 instead of queueing behind it forever. Leaves out: what the engines do, and HTTP.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rollmatch.errors import BackendError

GENERATION = "generation"
_POLL_S = 0.5


class EngineGuard:
    """Serialises engine use; reports a stalled generation (see the module docstring)."""

    def __init__(self, stall_timeout_s: float):
        self.stall_timeout_s = float(stall_timeout_s)
        self._lock = threading.Lock()
        self._holder: str | None = None
        self._held_since = 0.0
        self._last_progress = time.monotonic()

    def progress(self) -> None:
        """Called by the engine on every decoding step (cheap: one clock read)."""
        self._last_progress = time.monotonic()

    @contextmanager
    def hold(self, what: str) -> Iterator[None]:
        """Take the engine for ``what``; waits while it is busy, fails fast once it is stalled."""
        while not self._lock.acquire(timeout=_POLL_S):
            stalled = self.stalled()
            if stalled is not None:
                raise BackendError(f"the rollout engine is stalled ({stalled}); restart the server")
        self._holder, self._held_since = what, time.monotonic()
        self._last_progress = self._held_since
        try:
            yield
        finally:
            self._holder = None
            self._lock.release()

    def stalled(self) -> str | None:
        """Why the engine counts as stalled, or ``None`` while it is idle or making progress."""
        holder = self._holder
        if holder != GENERATION:
            return None  # weight loads make no decoding steps; their waits are bounded elsewhere
        quiet = time.monotonic() - max(self._last_progress, self._held_since)
        if quiet <= self.stall_timeout_s:
            return None
        held = time.monotonic() - self._held_since
        return (
            f"{holder} made no progress for {quiet:.0f}s (held the engine for {held:.0f}s; limit "
            f"--engine-stall-timeout-s {self.stall_timeout_s:.0f})"
        )

    @property
    def busy_with(self) -> str | None:
        return self._holder
