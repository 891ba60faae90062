"""Connection hygiene of the rollout server's HTTP loop: read deadlines and a connection cap.

Owns: :func:`guarded_h11_protocol`, uvicorn's h11 protocol with two additions uvicorn lacks:
- a **read deadline**: a request's head and body must arrive within ``read_timeout_s`` of its first
  byte (or of the connection's start), else the connection is closed. Slow clients (a header byte
  every few seconds), stalled bodies and connections that never send a request cannot pin memory
  or file descriptors. (uvicorn only times out idle kept-alive connections between requests.)
- a **connection cap**: over ``max_connections`` open connections, the oldest one that is not being
  answered (idle, or still sending its request) is closed to admit the new one, so a fresh
  ``/health/`` probe is answered even while idle or half-open connections pile up.

and :func:`raise_open_file_limit`. Leaves out: the routes (``server.app``) and request checks
(``server.gate``).
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


def guarded_h11_protocol(read_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """An h11 protocol class for ``uvicorn.Config(http=...)`` with these limits (one per server)."""
    open_connections: dict[GuardedH11Protocol, None] = {}  # insertion order = oldest first

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self._read_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            open_connections[self] = None
            self._arm_read_deadline()
            if len(open_connections) > max_connections:
                _evict_one(open_connections, self)

        def connection_lost(self, exc: Exception | None) -> None:
            open_connections.pop(self, None)
            self._disarm_read_deadline()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._read_deadline is None and self.between_requests:
                self._arm_read_deadline()  # the first byte of the next request on a kept-alive connection
            super().data_received(data)
            if self.cycle is not None and not self.cycle.more_body:
                self._disarm_read_deadline()  # the whole request is in

        @property
        def between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        @property
        def being_answered(self) -> bool:
            """A request fully received and not yet answered: never evicted."""
            return self.cycle is not None and not self.cycle.more_body and not self.cycle.response_complete

        def _arm_read_deadline(self) -> None:
            self._disarm_read_deadline()
            self._read_deadline = self.loop.call_later(read_timeout_s, self._read_deadline_passed)

        def _disarm_read_deadline(self) -> None:
            if self._read_deadline is not None:
                self._read_deadline.cancel()
                self._read_deadline = None

        def _read_deadline_passed(self) -> None:
            self._read_deadline = None
            if not self.transport.is_closing():
                log.info(
                    "closing connection from %s: no complete request within %gs (--request-read-timeout-s)",
                    self.client,
                    read_timeout_s,
                )
                self.transport.close()

    return GuardedH11Protocol


def _evict_one(connections: dict[Any, None], newcomer: Any) -> None:
    """Close the oldest connection not being answered (the newcomer itself when all others are)."""
    victim = next((c for c in connections if c is not newcomer and not c.being_answered), newcomer)
    connections.pop(victim, None)
    log.warning(
        "connection cap reached (%d open, --max-connections): closing the oldest idle or half-sent one from %s",
        len(connections) + 1,
        victim.client,
    )
    victim.transport.close()


def raise_open_file_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit (sockets are files); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    return soft
