"""Connection hygiene of the rollout server's HTTP loop: read deadlines and a connection cap.

Owns: :func:`guarded_h11_protocol`, uvicorn's h11 protocol with two additions uvicorn lacks:
- a **read deadline**: a request's head and body must arrive within ``read_timeout_s`` of its first
  byte (or of the connection's start, or, for a request pipelined behind another, of the moment
  the one before it was answered), else the connection is closed. Slow clients (a header byte
  every few seconds), stalled bodies and connections that never send a request cannot pin memory
  or file descriptors. (uvicorn only times out idle kept-alive connections between requests.)
- a **bound on pipelined bytes**: while a whole request is being answered (its call may wait for
  the engine for minutes), the connection may send at most :data:`MAX_PIPELINED_BYTES` more
  (a next request's head); past that it is closed (uvicorn buffered them without bound).
- a **connection cap**: over ``max_connections`` open connections, the oldest one with no request
  head in progress (one that never completed a head: new or half-sent; else an idle kept-alive
  one) is closed to admit the new one. A connection whose request head arrived (an upload that
  passed the token check, a call being answered) is never closed for the cap. When every
  connection has one, up to :data:`HEALTH_RESERVE` more are admitted for ``/health/`` only: any
  other request on them is answered 503 and the connection closed, so a probe is answered even
  while the server is full of calls. A reserved slot is not held by waiting: its connection must
  send its request head within :data:`HEALTH_SLOT_HEAD_TIMEOUT_S`, is closed after its answer
  (``Connection: close``), and when every slot is taken a newcomer takes the slot of the oldest one
  that has not sent a whole head yet (idle or trickling), so idle or slow connections cannot keep
  a probe out.

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
HEALTH_RESERVE = 16  # connections past the cap, for /health/ only
# A probe sends its head at once; a reserved slot waits no longer than this for it.
HEALTH_SLOT_HEAD_TIMEOUT_S = 2.0
MAX_PIPELINED_BYTES = 64 << 10  # bytes a connection may send while its request is being answered
_HEALTH_PATHS = frozenset({"/health/", "/health"})


def guarded_h11_protocol(read_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """An h11 protocol class for ``uvicorn.Config(http=...)`` with these limits (one per server)."""
    open_connections: dict[GuardedH11Protocol, None] = {}  # insertion order = oldest first
    health_only: dict[GuardedH11Protocol, None] = {}  # admitted past the cap, for /health/ only

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self._read_deadline: asyncio.TimerHandle | None = None
            self._counted_cycle: object = None
            self._pipelined = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_read_deadline()
            if len(open_connections) < max_connections or _evict_one(open_connections):
                open_connections[self] = None
            elif len(health_only) < HEALTH_RESERVE or _free_health_slot(health_only):
                health_only[self] = None
                self.app = _health_only(self.app)
                self._arm_read_deadline(min(read_timeout_s, HEALTH_SLOT_HEAD_TIMEOUT_S))
            else:
                log.warning(
                    "connection cap reached (%d open, --max-connections, every one busy; %d more kept for "
                    "/health/): closing the new connection from %s",
                    len(open_connections),
                    HEALTH_RESERVE,
                    self.client,
                )
                transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            open_connections.pop(self, None)
            health_only.pop(self, None)
            self._disarm_read_deadline()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._read_deadline is None and self.between_requests:
                self._arm_read_deadline()  # the first byte of the next request on a kept-alive connection
            if self.request_in and self._pipelined_too_much(len(data)):
                return
            super().data_received(data)
            if self.cycle is not None and not self.cycle.more_body:
                self._disarm_read_deadline()  # the whole request is in

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # A pipelined request that was waiting behind this one starts now, without a byte
            # arriving: its head or body may be incomplete, so it gets a read deadline of its own.
            if not self.transport.is_closing() and (self._body_incomplete or self.conn.trailing_data[0]):
                self._arm_read_deadline()

        @property
        def request_in(self) -> bool:
            """The current request arrived whole and is being answered (its call may wait long)."""
            return self.cycle is not None and not self.cycle.more_body and not self.cycle.response_complete

        @property
        def _body_incomplete(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete and self.cycle.more_body

        def _pipelined_too_much(self, size: int) -> bool:
            """Count bytes that arrive while a whole request is being answered (they belong to a next,
            pipelined request, buffered until this answer is sent; the disconnect check keeps reading
            them); past one request head's limit the connection is closed. ``True``: closed."""
            if self._counted_cycle is not self.cycle:
                self._counted_cycle, self._pipelined = self.cycle, 0
            self._pipelined += size
            if self._pipelined <= MAX_PIPELINED_BYTES:
                return False
            log.warning(
                "closing connection from %s: %d bytes sent while its request was being answered, over the "
                "%d a pipelined request head may take",
                self.client,
                self._pipelined,
                MAX_PIPELINED_BYTES,
            )
            self.transport.close()
            return True

        @property
        def between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        @property
        def head_received(self) -> bool:
            """The current request's head arrived (its body may still be arriving): never evicted."""
            return self.cycle is not None and not self.cycle.response_complete

        @property
        def never_sent_a_head(self) -> bool:
            return self.cycle is None

        def _arm_read_deadline(self, seconds: float = read_timeout_s) -> None:
            self._disarm_read_deadline()
            self._read_deadline = self.loop.call_later(seconds, self._read_deadline_passed)

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


def _evict_one(connections: dict[Any, None]) -> bool:
    """Close the oldest connection that never sent a request head, else the oldest idle kept-alive
    one; ``False`` when every connection has a request head in progress (nothing closed)."""
    victim = next((c for c in connections if c.never_sent_a_head), None)
    if victim is None:
        victim = next((c for c in connections if not c.head_received), None)
    if victim is None:
        return False
    connections.pop(victim, None)
    log.warning(
        "connection cap reached (%d open, --max-connections): closing the oldest one with no request head "
        "in progress, from %s",
        len(connections) + 1,
        victim.client,
    )
    victim.transport.close()
    return True


def _free_health_slot(health_only: dict[Any, None]) -> bool:
    """Close the oldest ``/health/``-only connection that has not sent a whole request head (idle or
    trickling); ``False`` when every one is being answered (nothing closed)."""
    victim = next((c for c in health_only if c.never_sent_a_head), None)
    if victim is None:
        return False
    health_only.pop(victim, None)
    log.info("every /health/ slot taken: closing the oldest one with no request head, from %s", victim.client)
    victim.transport.close()
    return True


def _health_only(app: Any) -> Any:
    """``app`` for a connection admitted past the cap: ``/health/`` only, anything else a 503 that
    closes the connection."""

    async def closing(message: Any, send: Any) -> None:
        if message["type"] == "http.response.start":  # the slot is free once the answer is sent
            headers = [(k, v) for k, v in message.get("headers") or [] if k.lower() != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)

    async def guarded(scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("path") in _HEALTH_PATHS:
            await app(scope, receive, lambda message: closing(message, send))
            return
        body = (
            b'{"detail":"the server is at its connection cap (rollmatch serve --max-connections) with every '
            b'connection busy; this connection is kept for /health/ only: retry later"}'
        )
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            (b"retry-after", b"1"),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return guarded


def raise_open_file_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit (sockets are files); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    return soft
