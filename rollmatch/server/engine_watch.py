"""The engine watchdog: what the engine thread is doing, since when, and when it last made progress.

Owns: :class:`EngineWatch`. The engine thread (``server.scheduler``) wraps every engine operation
(generation steps, admissions, weight loads, cache resets) in :meth:`EngineWatch.operation`;
engines call :meth:`EngineWatch.progress` on every model forward and every tensor loaded, the
scheduler on every prompt admitted. An operation that makes no progress for
``stall_timeout_s`` is a *stalled* engine: ``/health/`` answers 503 naming the operation, and calls
waiting for the engine fail with a 503 instead of waiting forever. Reads are lock-free (plain
attribute reads), so health probes never wait for the engine. Leaves out: what the operations do,
and HTTP.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

GENERATION = "generation"
WEIGHT_LOAD = "weight load"
CACHE_RESET = "cache reset"
ADMISSION = "admission"


class EngineWatch:
    """Current engine operation and its liveness (see the module docstring)."""

    def __init__(self, stall_timeout_s: float):
        self.stall_timeout_s = float(stall_timeout_s)
        self._operation: str | None = None
        self._since = 0.0
        self._last_progress = time.monotonic()

    def progress(self) -> None:
        """Called by the engine on every model forward (cheap: one clock read)."""
        self._last_progress = time.monotonic()

    @contextmanager
    def operation(self, what: str) -> Iterator[None]:
        """Mark the block as the engine doing ``what`` (only the engine thread calls this)."""
        self._since = self._last_progress = time.monotonic()
        self._operation = what
        try:
            yield
        finally:
            self._operation = None

    @property
    def current(self) -> str | None:
        """The operation under way, or ``None`` while the engine thread is between operations."""
        return self._operation

    def stalled(self) -> str | None:
        """Why the engine counts as stalled, or ``None`` while it is idle or making progress."""
        operation = self._operation
        if operation is None:
            return None
        now = time.monotonic()
        quiet = now - max(self._last_progress, self._since)
        if quiet <= self.stall_timeout_s:
            return None
        return (
            f"{operation} made no progress for {quiet:.0f}s (running for {now - self._since:.0f}s; limit "
            f"--engine-stall-timeout-s {self.stall_timeout_s:g})"
        )
