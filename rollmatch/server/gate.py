"""What every request passes before a route sees it: the shared-token check and the body-size cap.

Owns: :class:`RequestGate`, a plain ASGI middleware. Every ``POST`` (inference and every weight-sync
or cache endpoint) needs ``Authorization: Bearer <key>`` when the server has an API key
(``rollmatch serve --api-key`` / ``ROLLMATCH_API_KEY``); a missing or wrong token is a 401 before
the body is read, so nothing changes. ``GET`` endpoints (health, info, stats, world size) are
read-only and stay open for probes. Bodies over ``--max-body-bytes`` are a 413, whether or not
they declare a ``Content-Length``. Leaves out: the routes (``server.app``).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import HTTPException

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class RequestGate:
    """ASGI middleware: token on every POST (when configured), then the body-size cap."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int):
        self.app = app
        self._expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if scope.get("method") == "POST" and self._expected is not None:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                reason = "missing" if not given else "wrong"
                await _reply(
                    send,
                    401,
                    f"{reason} API key: send `Authorization: Bearer <key>` with the key the server was started "
                    "with (rollmatch serve --api-key / ROLLMATCH_API_KEY)",
                    [(b"www-authenticate", b"Bearer")],
                )
                return
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _reply(send, 413, self._too_large(int(declared)))
            return
        await self.app(scope, self._counting(receive), send)

    def _counting(self, receive: Receive) -> Receive:
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    # Raised inside the route's body read: FastAPI answers it as it is.
                    raise HTTPException(status_code=413, detail=self._too_large(received))
            return message

        return counted

    def _too_large(self, size: int) -> str:
        return (
            f"request body of {size}+ bytes is over this server's limit of {self.max_body_bytes} bytes "
            "(rollmatch serve --max-body-bytes); send fewer or smaller images per call"
        )


async def _reply(
    send: Send, status: int, detail: str, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body})
