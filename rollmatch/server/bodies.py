"""Request bodies at the rollout server's boundary: read under a route's cap, held under a budget.

Owns: :class:`BodyBudget` (the raw bytes of every ``/infer/`` body held at once: being received,
parsed or prepared, ``--max-inflight-body-bytes``) with the :class:`BodyLease` one call holds until
it drops its body, :func:`read_body` (a body streamed in under a byte cap, reserving from the
budget as it arrives, never cached on the request) and :func:`parse_json_body` (raw bytes validated
as a wire model with FastAPI's rules for a declared body). Leaves out: the global body-size cap and
the token (``server.gate``), and which route takes which body (``server.app``).

A body is reserved from its ``Content-Length`` before its first byte is read, so a server full of
uploads answers a new one 429 without receiving it; a body without a length (chunked) reserves
chunk by chunk. The lease is given back once the call is prepared (the body is no longer needed:
the engine waits on prompt ids and decoded pixels, not on base64), or when the call fails.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from rollmatch.errors import ServerBusy
from rollmatch.server.limits import RequestTooLarge

_MAX_ERRORS_KEPT = 64  # errors of one body kept at all (wire lists are fail-fast: a few)
ModelT = TypeVar("ModelT", bound=BaseModel)


class BodyBudget:
    """Raw body bytes all calls may hold together (thread-safe): over it, a 429 while others hold
    them; a body alone over it, a 413 naming ``flag``."""

    def __init__(self, max_bytes: int, flag: str = "--max-inflight-body-bytes"):
        self.max_bytes, self.flag = max_bytes, flag
        self._lock = threading.Lock()
        self._held = 0

    @property
    def held(self) -> int:
        """Bytes held by bodies in flight now."""
        return self._held

    def lease(self) -> BodyLease:
        """An empty lease; :meth:`BodyLease.grow` takes bytes into it."""
        return BodyLease(self)

    def _take(self, size: int, total: int) -> None:
        if total > self.max_bytes:
            raise RequestTooLarge(
                "body",
                f"request body of {total}+ bytes is over what this server holds for all bodies in flight, "
                f"{self.max_bytes} bytes (rollmatch serve {self.flag}); send fewer or smaller images per call",
            )
        with self._lock:
            if self._held + size > self.max_bytes:
                raise ServerBusy(
                    f"the server holds {self._held} bytes of request bodies in flight; this body's {size} more "
                    f"would pass its limit of {self.max_bytes} (rollmatch serve {self.flag}); retry later or "
                    "add servers",
                    retry_after_s=1.0,
                )
            self._held += size

    def _give(self, size: int) -> None:
        with self._lock:
            self._held -= size


class BodyLease:
    """The body bytes one call holds until :meth:`release` (idempotent; also on garbage collection)."""

    def __init__(self, budget: BodyBudget):
        self.budget = budget
        self._bytes = [0]  # shared with the finalizer, which must not hold the lease
        self._finalizer = weakref.finalize(self, _give_back, budget, self._bytes)

    @property
    def bytes(self) -> int:
        return self._bytes[0]

    def grow(self, size: int) -> None:
        """Hold ``size`` more bytes (413 / 429 as :class:`BodyBudget`)."""
        self.budget._take(size, self._bytes[0] + size)
        self._bytes[0] += size

    def release(self) -> None:
        self._finalizer()


def _give_back(budget: BodyBudget, held: list[int]) -> None:
    budget._give(held[0])
    held[0] = 0


async def read_body(request: Request, *, max_bytes: int, flag: str, lease: BodyLease | None = None) -> bytes:
    """The request's body, at most ``max_bytes`` (a 413 naming ``flag``; a declared ``Content-Length``
    over it is refused before any byte is read). With ``lease``, the declared length is reserved
    first and every byte past it as it arrives. The body is not cached on ``request``."""
    declared = request.headers.get("content-length", "")
    size = int(declared) if declared.isdigit() else None
    if size is not None and size > max_bytes:
        raise _over(size, max_bytes, flag)
    if lease is not None and size:
        lease.grow(size)
    chunks: list[bytes] = []
    received = 0
    try:
        async for chunk in request.stream():
            received += len(chunk)
            if received > max_bytes:
                raise _over(received, max_bytes, flag)
            if lease is not None and received > lease.bytes:
                lease.grow(received - lease.bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ValueError("the client closed the connection before sending the whole body") from None
    return b"".join(chunks)


def _over(size: int, max_bytes: int, flag: str) -> RequestTooLarge:
    return RequestTooLarge(
        "body",
        f"request body of {size}+ bytes is over this route's limit of {max_bytes} bytes (rollmatch serve "
        f"{flag})",
    )


def parse_json_body(model: type[ModelT], raw: bytes, content_type: str | None) -> ModelT:
    """``raw`` validated as ``model`` with the same rules as a declared FastAPI JSON body: a missing
    or non-JSON content type, bad JSON (syntax, UTF-8, lone surrogates, nesting deeper than 200) or
    a bad field is a ``RequestValidationError`` (a 422 naming it, never echoing the input)."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise RequestValidationError(
            [
                {
                    "type": "content_type",
                    "loc": ("body",),
                    "msg": f"send the body as JSON with `Content-Type: application/json` (got {media_type or 'none'!r})",
                }
            ]
        )
    with (
        _collector_paused()
    ):  # the errors too: their count is bounded (fail-fast lists, one for unknown keys)
        try:
            return model.model_validate_json(raw)  # one pass in pydantic's parser: no Python dict first
        except ValidationError as exc:
            errors = exc.errors(include_input=False, include_url=False)[:_MAX_ERRORS_KEPT]
            more = exc.error_count() - len(errors)
    shown = [{**e, "loc": ("body", *e["loc"])} for e in errors]
    if more > 0:
        shown.append({"type": "more_errors", "loc": ("body",), "msg": f"{more} more errors not shown"})
    raise RequestValidationError(shown)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a body is parsed: the parser creates only acyclic
    values, and with the collector on, every few hundred containers trigger a collection over all
    of them (the parser holds the GIL throughout): 280k empty lists took 1.4-2.5 s instead of 0.1-0.16 s,
    stalling ``/health/`` as long. Process-wide but brief; it is turned back on only if it was on."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
