"""One rollout server as the trainer sees it: JSON calls over a kept-alive HTTP session.

Owns: :class:`ServerConnection` (reachability, calls with explicit timeouts, the API token and the
sync lease on every request and the sync key on the calls that change the sync state, ``/health/``
watching of calls without a timeout, 429 backoff within the call's time, one resend of an
idempotent call whose connection closed before any answer, errors that name the URL and the
phase: :class:`~rollmatch.errors.ServerDown` when the server stopped answering, which a client may
fail over). Leaves out: what is sent (``rollmatch.protocol``), chunking
(``rollout.client``), weight pushes (``rollout.weight_push``), and how images are encoded (``rollout.image_wire``).

Connections are reused: every call of one ``ServerConnection`` goes through one
``requests.Session`` (HTTP keep-alive), so a rollout call costs no TCP handshake while the server
keeps the connection open. The exception are the calls that change the sync state
(``protocol.SYNC_STATE_CHANGES``: init, bucket announcements, finish): each posts a receive on the
group or moves the lease, so a second copy would desynchronise the group. Each goes out on a fresh
connection (a kept-alive one the server closed while idle cannot swallow it), and is never sent
again: a connection closed before its answer fails the call, naming the phase, and the next push
forms a fresh group.
"""

from __future__ import annotations

import os
import random
import threading
import time
from http.client import RemoteDisconnected
from typing import Any
from urllib.parse import urlparse

import requests

from rollmatch.config.schema import ROLLOUT_KEY
from rollmatch.errors import BackendError, ServerBusy, ServerDown, SyncError
from rollmatch.protocol import (
    API_KEY_ENV,
    LEASE_HEADER,
    SYNC_KEY_ENV,
    SYNC_KEY_HEADER,
    SYNC_STATE_CHANGES,
    WireModel,
)

_HEALTH_POLL_S = 5.0
KEY = f"{ROLLOUT_KEY}.vllm"
ALTERNATIVES = f"or set `{KEY}.mode: colocate` / `{ROLLOUT_KEY}.rollout_backend: hf`"
_NO_TIMEOUT_GIVEN = -1.0
_FIRST_BUSY_WAIT_S, _MAX_BUSY_WAIT_S = 0.25, 10.0  # 429 backoff: the jitter window's first and largest size
_JITTER = random.Random()


class ServerConnection:
    """One rollout server: JSON over HTTP with explicit timeouts; implements ``ControlChannel``.

    Every request carries ``Authorization: Bearer $ROLLMATCH_API_KEY`` when that variable is set,
    and, once ``/init_communicator/`` handed one out, the sync lease; the calls that change the sync
    state carry ``$ROLLMATCH_SYNC_KEY`` when it is set. A call made without an HTTP
    timeout (``/infer/`` with ``infer_timeout_s: null``) is watched: ``/health/`` is polled while it
    is outstanding, and the call fails naming the URL once the server stops answering for
    ``timeout_s`` or reports itself unhealthy.
    """

    def __init__(self, url: str, group_port: int, *, timeout_s: float, infer_timeout_s: float | None):
        self.url = url.rstrip("/")
        self.group_port = group_port
        self.timeout_s = timeout_s
        self.infer_timeout_s = infer_timeout_s if infer_timeout_s and infer_timeout_s > 0 else None
        self.host = urlparse(self.url).hostname or "127.0.0.1"
        self.session = requests.Session()
        api_key = os.environ.get(API_KEY_ENV)
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        self.sync_key = os.environ.get(SYNC_KEY_ENV) or None
        self.sync_lease: str | None = None

    def wait_healthy(self) -> None:
        """Poll ``/health/`` until it answers, at most ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        last = "no answer"
        while True:
            try:
                reply = self.session.get(f"{self.url}/health/", timeout=min(5.0, self.timeout_s))
                if reply.status_code == 200:
                    return
                last = f"HTTP {reply.status_code}: {reply.text[:200]}"
            except requests.RequestException as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise BackendError(
                    f"rollout server {self.url} is not reachable after {self.timeout_s:.0f}s "
                    f"({KEY}.server.timeout_s); last error: {last}. Start it with `rollmatch serve --model "
                    f"<model.path> --port <port>` and check the URL, {ALTERNATIVES}"
                )
            time.sleep(0.5)

    def get(self, path: str, phase: str) -> dict[str, Any]:
        return self._call("GET", path, None, phase, self.timeout_s).json()

    def post(
        self, path: str, body: WireModel | None, phase: str, timeout_s: float | None = _NO_TIMEOUT_GIVEN
    ) -> Any:
        """POST ``body`` as JSON and return the parsed JSON answer (``timeout_s`` ``None``: watched, no timeout)."""
        payload = None if body is None else encode_body(body)
        return self.post_bytes(path, payload, phase, timeout_s).json()

    def post_bytes(
        self, path: str, payload: bytes | None, phase: str, timeout_s: float | None = _NO_TIMEOUT_GIVEN
    ) -> requests.Response:
        """POST an already-serialised JSON body; the 200 answer as it came (any other status raises)."""
        timeout = self.timeout_s if timeout_s == _NO_TIMEOUT_GIVEN else timeout_s
        if timeout is None:
            return self._watched_call("POST", path, payload, phase)
        return self._call("POST", path, payload, phase, timeout)

    def _call(
        self, method: str, path: str, payload: bytes | None, phase: str, timeout: float | None
    ) -> requests.Response:
        """One call; a 429 (server full) is retried with full jitter while the call's time
        (``timeout``, else ``timeout_s``) lasts: each wait is drawn uniformly from zero to the larger of
        ``Retry-After`` and a doubling backoff, so clients refused together do not come back together.
        An idempotent call whose connection closed before any byte of the answer (the server closed an
        idle kept-alive connection as it was reused) is sent again once. A call that changes the sync
        state goes out on a fresh connection and is never sent again (see the module docstring)."""
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        if self.sync_lease:
            headers[LEASE_HEADER] = self.sync_lease
        once = method == "POST" and path in SYNC_STATE_CHANGES
        if once and self.sync_key:
            headers[SYNC_KEY_HEADER] = self.sync_key
        deadline = time.monotonic() + (timeout if timeout is not None else self.timeout_s)
        busy_wait_s, reconnected = _FIRST_BUSY_WAIT_S, False
        while True:
            try:
                reply = self._send(method, path, payload, timeout, headers, fresh_connection=once)
            except requests.Timeout as exc:
                raise ServerDown(
                    f"rollout server {self.url}: {phase} ({method} {path}) got no answer within {timeout}s"
                ) from exc
            except requests.RequestException as exc:
                if once and closed_before_answer(exc):
                    raise SyncError(
                        f"rollout server {self.url}: {phase} ({method} {path}): the connection closed before "
                        "any answer, after the request may have reached the server; a weight-sync call is not "
                        "sent twice (a second copy would desynchronise the group), so this push fails and the "
                        "next one forms a fresh group"
                    ) from exc
                if not reconnected and closed_before_answer(exc):
                    reconnected = True
                    continue
                raise ServerDown(
                    f"rollout server {self.url}: {phase} ({method} {path}) failed: {exc}; is the server still "
                    f"running? {ALTERNATIVES}"
                ) from exc
            if reply.status_code != 429:
                break
            window_s = max(busy_wait_s, retry_after_s(reply))
            wait_s = _JITTER.uniform(0.0, window_s)
            if time.monotonic() + wait_s > deadline:
                raise ServerBusy(
                    f"rollout server {self.url}: {phase} ({method} {path}) -> HTTP 429 until the call's time ran "
                    f"out: {detail_of(reply)}. Add servers, send fewer rollouts at once, or raise the server's "
                    "--max-queued-prompts",
                    retry_after_s=window_s,
                )
            time.sleep(wait_s)
            busy_wait_s = min(busy_wait_s * 2, _MAX_BUSY_WAIT_S)
        if reply.status_code != 200:
            detail = detail_of(reply)
            error = SyncError if reply.status_code == 409 else BackendError
            if reply.status_code >= 500 and not once:  # broken or stalled: other servers may answer
                error = ServerDown
            hint = {
                401: f" (set {API_KEY_ENV} to the server's --api-key)",
                403: f" (set {SYNC_KEY_ENV} to the server's --sync-key)",
            }.get(reply.status_code, "")
            raise error(
                f"rollout server {self.url}: {phase} ({method} {path}) -> HTTP {reply.status_code}: {detail}{hint}"
            )
        return reply

    def _send(
        self,
        method: str,
        path: str,
        payload: bytes | None,
        timeout: float | None,
        headers: dict[str, str],
        *,
        fresh_connection: bool,
    ) -> requests.Response:
        if not fresh_connection:
            return self.session.request(
                method, f"{self.url}{path}", data=payload, timeout=timeout, headers=headers
            )
        with requests.Session() as session:  # its own connection, closed after the answer
            session.headers.update(self.session.headers)
            return session.request(
                method, f"{self.url}{path}", data=payload, timeout=timeout, headers=headers
            )

    def _watched_call(self, method: str, path: str, payload: bytes | None, phase: str) -> requests.Response:
        """A call without an HTTP timeout, run in a daemon thread while ``/health/`` is polled here."""
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                outcome["value"] = self._call(method, path, payload, phase, None)
            except BaseException as exc:  # handed to the caller's thread below
                outcome["error"] = exc
            finally:
                done.set()

        threading.Thread(target=run, name=f"rollout-call {self.url}", daemon=True).start()
        probe: requests.Session | None = None  # opened at the first probe: most calls answer before it
        last_answer, last_problem = time.monotonic(), "no answer yet"
        poll_s = max(0.2, min(_HEALTH_POLL_S, self.timeout_s / 4))
        try:
            while not done.wait(poll_s):
                if probe is None:
                    probe = requests.Session()
                    probe.headers.update(self.session.headers)
                try:
                    reply = probe.get(f"{self.url}/health/", timeout=min(_HEALTH_POLL_S, self.timeout_s))
                except requests.RequestException as exc:
                    last_problem = f"{type(exc).__name__}: {exc}"
                else:
                    if reply.status_code == 200:
                        last_answer = time.monotonic()
                        continue
                    if reply.status_code == 503:  # broken or stalled: it will not answer this call
                        raise ServerDown(
                            f"rollout server {self.url}: {phase} ({method} {path}) abandoned: the server reports "
                            f"itself unhealthy: {detail_of(reply)}; restart it"
                        )
                    last_problem = f"HTTP {reply.status_code}"
                if time.monotonic() - last_answer > self.timeout_s:
                    raise ServerDown(
                        f"rollout server {self.url}: {phase} ({method} {path}) abandoned: GET /health/ got no "
                        f"answer for {self.timeout_s:.0f}s ({KEY}.server.timeout_s; last: {last_problem}); the "
                        f"server is frozen or gone. Restart it, {ALTERNATIVES}"
                    )
        finally:
            if probe is not None:
                probe.close()
        return self._outcome(outcome)

    @staticmethod
    def _outcome(outcome: dict[str, Any]) -> requests.Response:
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def close(self) -> None:
        self.session.close()


def closed_before_answer(exc: requests.RequestException) -> bool:
    """The server closed the connection before any byte of its answer (safe to send again):
    somewhere in the exception's chain (urllib3 nests it in ``args``) a reset or a remote close."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, RemoteDisconnected | ConnectionResetError | BrokenPipeError):
            return True
        seen.add(id(cause))
        nested = [a for a in getattr(cause, "args", ()) if isinstance(a, BaseException)]
        cause = nested[0] if nested else cause.__cause__ or cause.__context__
    return False


def retry_after_s(reply: requests.Response) -> float:
    """A 429's ``Retry-After`` in seconds (HTTP dates are not sent by rollmatch servers: 1 s then)."""
    value = reply.headers.get("Retry-After", "")
    try:
        return min(max(float(value), 0.0), _MAX_BUSY_WAIT_S)
    except ValueError:
        return 1.0


def encode_body(body: WireModel) -> bytes:
    """A wire model as the JSON bytes of a request body (``None`` fields left out), written by
    pydantic's serialiser in one pass (no intermediate dict; wire models hold no NaN / Infinity)."""
    return body.model_dump_json(exclude_none=True).encode()


def detail_of(reply: requests.Response) -> str:
    """The server's error message (``detail``), or the start of the body when it is not JSON."""
    try:
        body = reply.json()
    except ValueError:
        return reply.text[:2000]
    return str(body.get("detail", reply.text) if isinstance(body, dict) else reply.text)[:2000]
