"""What the engine thread queues: one ``/infer/`` call (:class:`CallTicket`) and one exclusive
engine operation (:class:`EngineOperation`), each with its result and done-callbacks.

Owns: the two records and their completion (``_finish`` runs the callbacks, from the engine
thread). Leaves out: the queues and the thread that serves them (``server.scheduler``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rollmatch.rollout.types import Decoding

if TYPE_CHECKING:
    from rollmatch.server.engines import EngineOutput
    from rollmatch.server.prompt_preparer import PreparedPrompt


class _Completion:
    """The completion both records share: ``done``, ``error`` and the done-callbacks (fields of each)."""

    done: threading.Event
    error: BaseException | None
    _callbacks: list[Callable[[], None]]

    def on_done(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` (from the engine thread) once this is done; at once if it is."""
        self._callbacks.append(callback)
        if self.done.is_set():
            callback()

    def forget(self, callback: Callable[[], None]) -> None:
        """Drop a callback registered with :meth:`on_done` (its waiter gave up)."""
        if callback in self._callbacks:
            self._callbacks.remove(callback)

    def _finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self.done.set()
        for callback in list(self._callbacks):
            callback()


@dataclass(eq=False)  # identity: a ticket is one call, found in the queues by ``is``
class CallTicket(_Completion):
    """One submitted call: its prompts, where it stands, and (once done) its outputs or error."""

    call_id: int
    prompts: list[PreparedPrompt]
    decoding: Decoding
    seed: int | None
    prompt_tokens: int
    stop: tuple[str, ...] = ()  # stop strings the engine stops at (the server trims at them too)
    outputs: list[EngineOutput | None] = field(default_factory=list)
    first_version: int = -1
    last_version: int = -1
    attempts: int = 0  # admissions: a call aborted by a weight update is admitted again
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    _callbacks: list[Callable[[], None]] = field(default_factory=list)

    @property
    def versions(self) -> tuple[int, int]:
        """(first, last) weight version that produced the outputs; equal except in ``keep`` mode."""
        return self.first_version, self.last_version

    def request_id(self, index: int) -> str:
        return f"c{self.call_id}.{self.attempts}.{index}"


@dataclass(eq=False)
class EngineOperation(_Completion):
    """An exclusive engine operation; ``fn`` returns the new weight version (a load) or ``None``.
    ``label`` names a load in the broken reason (e.g. ``weight version 3 (full)``)."""

    what: str
    fn: Callable[[], int | None]
    is_load: bool
    label: str = ""
    queued_at: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    _callbacks: list[Callable[[], None]] = field(default_factory=list)
