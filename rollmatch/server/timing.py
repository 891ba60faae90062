"""Where the rollout server spends one request's time: named phases, reported to the client.

Owns: :class:`PhaseTimes`, exclusive wall time per phase of one request (a phase nested in another
counts only for itself), which ``/infer/`` sends back in its ``Server-Timing`` header
(``rollmatch.protocol.format_server_timing``). Leaves out: what the phases are (the route and
:meth:`~rollmatch.server.rollout_server.RolloutServer.prepare` name them) and the client's side.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class PhaseTimes:
    """Seconds per phase of one request, in first-seen order; used by one thread at a time."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._open: list[str] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as ``name``; the time of phases nested in it is not counted twice."""
        start = time.perf_counter()
        self._open.append(name)
        try:
            yield
        finally:
            self._open.pop()
            elapsed = time.perf_counter() - start
            self.seconds[name] = self.seconds.get(name, 0.0) + elapsed
            if self._open:
                parent = self._open[-1]
                self.seconds[parent] = self.seconds.get(parent, 0.0) - elapsed
