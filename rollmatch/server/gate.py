"""Who may call the rollout server, and what every request passes before a route sees it.

Owns: the API key's sources and checks (:func:`server_api_key`: ``--api-key``, ``--api-key-file`` or
``$ROLLMATCH_API_KEY``; the weight-sync key's likewise, :func:`server_sync_key`), the start-up rule that a server bound to a non-loopback address has a key
(:func:`check_exposure`, ``--insecure-no-auth`` to override; loopback stays open for local work),
and :class:`RequestGate`, a plain ASGI middleware: the token check, then the body-size cap.

With a key, every request needs ``Authorization: Bearer <key>``: every ``POST`` (inference, weight
sync, cache), ``/info/``, ``/stats/``, ``/get_world_size/``, the generated API docs (``/docs``,
``/redoc``, ``/openapi.json``) and any unknown path (401, so a caller without the key cannot map
the routes). A missing or wrong token is a 401 before the body is read, so nothing changes. Only
``GET``/``HEAD /health/`` stays open: liveness probes (the launcher, a load balancer, an
orchestrator) hold no key, and it answers only engine state, queue depths and the weight version;
the reason behind a 503 (exception text) only to a caller with the key (:data:`AUTHENTICATED`
in the request scope tells the route). A body must come with a ``Content-Length``: a chunked one
is a 411 and one with both length headers a 400; a body over ``--max-body-bytes`` is a 413 (from
its declared length, else as it arrives). Every answer sent before the body was read to its end
carries ``Connection: close``: the server closes the connection instead of parsing the rest of an
unwanted upload; a 401 always does (a caller without the key keeps no connection). Refusals
for a missing or wrong key are logged at most once per :data:`REFUSAL_LOG_INTERVAL_S` with how
many were refused since the last line (:class:`RefusalLog`), so a client looping without the key
cannot flood the log. Websocket connections (no route takes one) are refused before
any route sees them; ``lifespan`` events pass.
Leaves out: the routes (``server.app``) and the flags (``rollmatch.cli``).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

from fastapi import HTTPException

from rollmatch.errors import ConfigError, ConfigProblem
from rollmatch.protocol import API_KEY_ENV, SYNC_KEY_ENV

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health/", "/health"})  # "/health" only answers the redirect to "/health/"
OPEN_METHODS = frozenset({"GET", "HEAD"})
AUTHENTICATED = "rollmatch.authenticated"  # scope key: the request carried the key (or none is set)
_NEW_KEY = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
REFUSAL_LOG_INTERVAL_S = 10.0  # at most one log line per this for requests refused for their key
log = logging.getLogger(__name__)


def server_api_key(api_key: str | None, api_key_file: str | None, environ: Mapping[str, str]) -> str | None:
    """The server's key from ``--api-key``, else ``--api-key-file``, else ``$ROLLMATCH_API_KEY``
    (``None``: no key). An empty variable counts as unset, as it does for the trainer; an empty flag,
    an empty / missing / unreadable file, both flags together or a key that cannot travel unchanged
    in an HTTP header (whitespace, non-ASCII) is a :class:`ConfigError`. A file's trailing newline
    is not part of the key."""
    return _server_key("--api-key", API_KEY_ENV, api_key, api_key_file, environ)


def server_sync_key(
    sync_key: str | None, sync_key_file: str | None, environ: Mapping[str, str], api_key: str | None
) -> str | None:
    """The weight-sync key from ``--sync-key``, else ``--sync-key-file``, else ``$ROLLMATCH_SYNC_KEY``
    (``None``: none), with the API key's rules; one equal to ``api_key`` separates nothing and is a
    :class:`ConfigError`."""
    key = _server_key("--sync-key", SYNC_KEY_ENV, sync_key, sync_key_file, environ)
    if key is not None and api_key is not None and hmac.compare_digest(key.encode(), api_key.encode()):
        raise ConfigError(
            [
                ConfigProblem(
                    "--sync-key-file",
                    "<redacted>",
                    "the sync key equals the API key, so every API-key holder could replace the served "
                    f"weights; give a distinct key (e.g. from `{_NEW_KEY}`)",
                )
            ]
        )
    return key


def _server_key(
    flag: str, env_name: str, value: str | None, file: str | None, environ: Mapping[str, str]
) -> str | None:
    if value is not None and file is not None:
        raise ConfigError(
            [
                ConfigProblem(
                    f"{flag} / {flag}-file",
                    "both given",
                    f"give one: {flag}-file PATH keeps the key out of the process list",
                )
            ]
        )
    if file is not None:
        return _checked(f"{flag}-file", file, _read_key_file(f"{flag}-file", file))
    if value is not None:
        return _checked(flag, "<redacted>", value)
    from_env = environ.get(env_name)
    return _checked(f"${env_name}", "<redacted>", from_env) if from_env else None


def check_exposure(host: str, api_key: str | None, *, insecure_no_auth: bool) -> None:
    """Refuse (``ConfigError``) to serve without a key on a host that is not loopback, unless
    ``insecure_no_auth``: every endpoint, weight sync included, would be open to the network."""
    if api_key is not None or insecure_no_auth or is_loopback(host):
        return
    raise ConfigError(
        [
            ConfigProblem(
                "--host",
                host,
                "is not a loopback address and no API key is set: anyone who can reach it could run "
                "inference and replace the served weights. Give a key with --api-key-file PATH (or "
                f"{API_KEY_ENV}=KEY; the trainer sends the same variable), serve on --host 127.0.0.1, or pass "
                "--insecure-no-auth on a network you trust",
            )
        ]
    )


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback one (``127.0.0.0/8``, ``::1``); a host
    that does not resolve, ``0.0.0.0`` and ``::`` (every interface) are not."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]
    return bool(addresses) and all(_loopback_address(a) for a in addresses)


class RequestGate:
    """ASGI middleware: the token on every request but ``GET /health/`` (when a key is set), then the
    body-size cap."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int):
        self.app = app
        self._expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.refusals = RefusalLog()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await send(
                {"type": "websocket.close", "code": 1008, "reason": "the rollout server takes no websockets"}
            )
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        body_state = _BodyState(headers)
        send = body_state.closing(send)
        given = headers.get(b"authorization", b"")
        scope[AUTHENTICATED] = self._expected is None or hmac.compare_digest(given, self._expected)
        if not scope[AUTHENTICATED] and not _open_route(scope):
            reason = "missing" if not given else "wrong"
            self.refusals.refused(f"{scope.get('method')} {scope.get('path')!r}", reason, scope.get("client"))
            await _reply(
                send,
                401,
                f"{reason} API key: send `Authorization: Bearer <key>` with the key the server was started "
                f"with (rollmatch serve --api-key-file / --api-key / {API_KEY_ENV})",
                [(b"www-authenticate", b"Bearer"), (b"connection", b"close")],
            )
            return
        if b"transfer-encoding" in headers:
            # Chunked framing is parsed chunk by chunk on the event loop (1-byte chunks at 2 MB/s held
            # /health/ for 8.5 s); every rollmatch and ms-swift client sends a Content-Length.
            both = b"content-length" in headers
            await _reply(
                send,
                400 if both else 411,
                "a request may not carry both Content-Length and Transfer-Encoding (request smuggling); "
                "send Content-Length only"
                if both
                else "chunked request bodies are not accepted: send the body with a Content-Length",
            )
            return
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _reply(send, 413, self._too_large(int(declared)))
            return
        await self.app(scope, body_state.watching(self._counting(receive)), send)

    def _counting(self, receive: Receive) -> Receive:
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    # Raised inside the route's body read: FastAPI answers it (the send wrapper adds
                    # `Connection: close`, the rest of the body is never parsed).
                    raise HTTPException(status_code=413, detail=self._too_large(received))
            return message

        return counted

    def _too_large(self, size: int) -> str:
        return (
            f"request body of {size}+ bytes is over this server's limit of {self.max_body_bytes} bytes "
            "(rollmatch serve --max-body-bytes); send fewer or smaller images per call"
        )


class RefusalLog:
    """The log of requests refused for a missing or wrong API key, at most one line per
    ``interval_s``: the first refusal is logged at once, later ones are counted, and one line per
    interval (scheduled on the event loop, so a burst that stops is still reported) says how many
    were refused since and the latest of them."""

    def __init__(self, interval_s: float = REFUSAL_LOG_INTERVAL_S):
        self.interval_s = interval_s
        self.lines = 0  # lines written so far
        self._quiet_until = 0.0  # monotonic time before which refusals are only counted
        self._unlogged = 0
        self._latest = ""
        self._flush: asyncio.TimerHandle | None = None

    def refused(self, request: str, reason: str, client: Any) -> None:
        """Record one refusal (called on the event loop)."""
        shown = f"{request} from {_client_text(client)} ({reason} key)"
        now = time.monotonic()
        if now >= self._quiet_until:
            self._write(
                f"refused {shown}: send `Authorization: Bearer <key>` (rollmatch serve --api-key-file)"
            )
            return
        self._unlogged += 1
        self._latest = shown
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(self._quiet_until - now, self._summary)

    def _summary(self) -> None:
        self._flush = None
        count, self._unlogged = self._unlogged, 0
        self._write(
            f"refused {count} more request(s) without a valid API key in the last {self.interval_s:g}s "
            f"(latest: {self._latest}); such refusals are logged at most once every {self.interval_s:g}s"
        )

    def _write(self, line: str) -> None:
        log.warning("%s", line)
        self.lines += 1
        self._quiet_until = time.monotonic() + self.interval_s


def _client_text(client: Any) -> str:
    return f"{client[0]}:{client[1]}" if client else "an unknown client"


def _open_route(scope: Scope) -> bool:
    return scope.get("method") in OPEN_METHODS and scope.get("path") in OPEN_PATHS


def _read_key_file(flag: str, path: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        fix = f"no such file; write the key there first, e.g. `{_NEW_KEY} > {path}; chmod 600 {path}`"
    except (OSError, UnicodeDecodeError) as exc:
        fix = f"cannot be read ({type(exc).__name__}: {exc}); give a readable UTF-8 file holding only the key"
    else:
        return text.removesuffix("\n").removesuffix("\r")
    raise ConfigError([ConfigProblem(flag, path, fix)])


def _checked(source: str, shown: str, key: str) -> str:
    """``key`` if it can travel unchanged as ``Authorization: Bearer <key>``; else a ConfigError."""
    if not key.strip():
        fix = f"the key is empty; give a non-empty key (e.g. from `{_NEW_KEY}`)"
    elif not all("!" <= ch <= "~" for ch in key):
        fix = (
            "the key holds whitespace, control or non-ASCII characters, which do not reach the server "
            f"unchanged in an HTTP header; use printable ASCII only (e.g. from `{_NEW_KEY}`)"
        )
    else:
        return key
    raise ConfigError([ConfigProblem(source, shown, fix)])


def _loopback_address(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


class _BodyState:
    """Whether a request's body has been read to its end; a response that starts before then carries
    ``Connection: close``, so the server closes the connection once it is sent instead of parsing and
    discarding the rest of the body (a 401 or 413 without it kept uvicorn reading an unwanted upload
    for up to the read deadline)."""

    def __init__(self, headers: dict[bytes, bytes]):
        self.complete = (
            headers.get(b"content-length", b"0").strip() == b"0" and b"transfer-encoding" not in headers
        )

    def watching(self, receive: Receive) -> Receive:
        async def watched() -> Message:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                self.complete = True
            return message

        return watched

    def closing(self, send: Send) -> Send:
        async def sent(message: Message) -> None:
            if message["type"] == "http.response.start" and not self.complete:
                headers = list(message.get("headers") or [])
                if not any(name.lower() == b"connection" for name, _ in headers):
                    message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        return sent


async def _reply(
    send: Send, status: int, detail: str, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body})
