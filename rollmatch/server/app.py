"""The rollout server's HTTP surface (ms-swift ``swift rollout`` compatible): routes and error answers.

Owns: :func:`build_app`: thin FastAPI routes over :class:`~rollmatch.server.rollout_server.RolloutServer`
behind the :class:`~rollmatch.server.gate.RequestGate` (token, body size), and the mapping of every
error to one 4xx/5xx answer that names the field or the fix. A malformed request is always a 4xx:
validation errors are rendered without echoing the input (NaN / Infinity in a body cannot break
the answer), ``ValueError`` is a 400, a value over a cap a 413/422, weight-sync state a 409, an
unusable engine a 503. Leaves out: behaviour (``server.rollout_server``) and the process
(``server.serve``).

Endpoints: ``GET /health/`` (503 when a weight load failed half-way or the engine is stalled),
``/get_world_size/``, ``/info/``, ``/stats/``; ``POST /infer/``, ``/get_engine_type/``,
``/init_communicator/`` (returns the sync lease), ``/update_flattened_params/``,
``/update_adapter_flattened_param/``, ``/finish_weight_update/``, ``/close_communicator/`` (these
need the lease in ``X-Rollmatch-Sync-Lease``; ``/init_communicator/`` needs the sync key in
``X-Rollmatch-Sync-Key`` when the server has one: 403 without), ``/reset_prefix_cache/`` (the
lease, or the sync key when the server has one; a no-op on an engine without a prefix cache).
``/health/``, ``/info/`` and ``/stats/`` are ``async`` routes that read lock-free state on the event
loop: they never wait for the engine or for a worker thread (``/health/`` gives the reason behind a
503 only to a caller with the key). ``/infer/`` reads its body itself under the in-flight body
budget (``server.bodies``), checks, parses and prepares it in one worker-thread hop (the value bound
and the request count on the raw bytes first, then the JSON validated exactly as a declared body
would be), drops the body, then waits for the engine thread on the event loop (no thread held
while it queues: any number of calls can wait), and serialises the reply in a second hop. The
weight-sync routes check the lease from the head, then read the body under
``--max-sync-body-bytes`` and parse it in a worker thread. A full server answers 429 with
``Retry-After``. The answer carries the weight version (``X-Weight-Version``, the oldest when
``keep`` mode mixed two) and the phase times in a ``Server-Timing`` header (``receive``, ``parse``,
``prepare``, ``decode``, ``preprocess``, ``engine``, ``outputs``, ``respond``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Header, HTTPException, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from rollmatch.errors import BackendError, RollmatchError, ServerBusy, SyncError
from rollmatch.protocol import (
    INFER_REPLY,
    LEASE_HEADER,
    SERVER_TIMING_HEADER,
    SYNC_KEY_HEADER,
    FinishUpdateBody,
    FinishUpdateReply,
    InferBody,
    InitCommunicatorBody,
    InitCommunicatorReply,
    ServerHealth,
    ServerInfo,
    ServerStats,
    UpdateAdapterBody,
    UpdateFlattenedParamsBody,
    format_server_timing,
)
from rollmatch.server.bodies import read_body
from rollmatch.server.gate import AUTHENTICATED, RequestGate
from rollmatch.server.limits import RequestTooLarge
from rollmatch.server.rollout_server import PreparedCall, RolloutServer
from rollmatch.server.scheduler import CallTicket
from rollmatch.server.sync_session import SyncKeyRefused
from rollmatch.server.timing import PhaseTimes

log = logging.getLogger(__name__)
_MAX_ERRORS_SHOWN = 8
_DISCONNECT_POLL_S = 0.25
_MAX_ERRORS_KEPT = 64  # errors of one body kept at all (wire lists are fail-fast: a few)
ModelT = TypeVar("ModelT", bound=BaseModel)


def build_app(server: RolloutServer, *, api_key: str | None = None) -> FastAPI:
    """The FastAPI app over ``server``; ``api_key`` (``None``: open) guards every route, the API docs
    included, but ``GET /health/`` (see :mod:`rollmatch.server.gate`)."""
    app = FastAPI(title="rollmatch rollout server")
    app.add_middleware(RequestGate, api_key=api_key, max_body_bytes=server.limits.max_body_bytes)
    app.add_exception_handler(RequestValidationError, _validation_error)

    def call(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except (ValueError, RollmatchError) as exc:
            raise _http_error(exc) from exc

    @app.get("/health/")
    async def health(request: Request, response: Response) -> ServerHealth:
        report = server.health()
        if report.status != "ok":
            response.status_code = 503
        if report.detail is not None and not request.scope.get(AUTHENTICATED, False):
            # No internals (exception text) without the key: the state alone tells a probe enough.
            report = report.model_copy(
                update={"detail": f"{report.status}: send the API key for the reason, or read the server log"}
            )
        return report

    @app.get("/get_world_size/")
    def get_world_size() -> dict[str, int]:
        return {"world_size": server.engine.world_size}

    @app.post("/get_engine_type/")
    def get_engine_type() -> dict[str, Any]:
        return {
            "engine_type": "LLMEngine",
            "enable_multi_turn": False,
            "use_gym_env": False,
            "enable_lora": "adapter" in server.engine.sync_modes,
        }

    @app.get("/info/")
    async def info() -> ServerInfo:
        return server.info()

    @app.get("/stats/")
    async def stats() -> ServerStats:
        return server.stats()

    @app.post("/infer/")
    async def infer(request: Request) -> Response:
        times = PhaseTimes()
        body_lease = server.bodies.lease()
        held = [b""]  # the raw body, dropped once the call is prepared (the engine wait never holds it)
        try:
            with times.phase("receive"):
                held[0] = await read_body(
                    request, max_bytes=server.limits.max_body_bytes, flag="--max-body-bytes", lease=body_lease
                )
        except (ValueError, RollmatchError) as exc:
            body_lease.release()
            raise _http_error(exc) from exc
        except BaseException:  # the gate's 413, a cancelled request: the budget is given back at once
            body_lease.release()
            raise
        content_type = request.headers.get("content-type")

        def prepare() -> PreparedCall:  # worker-thread hop 1: parse and prepare (images decoded)
            try:
                with times.phase("parse"):
                    raw, held[0] = held[0], b""
                    call(server.check_body, raw)
                    body = parse_json_body(InferBody, raw, content_type)
                    del raw
                with times.phase("prepare"):
                    return call(server.prepare, body, times, gone.is_set)
            finally:
                held[0] = b""
                body_lease.release()

        def respond(prepared: PreparedCall, ticket: CallTicket | None) -> bytes:  # hop 2
            with times.phase("outputs"):
                outputs = call(server.outputs, prepared, ticket)
            with times.phase("respond"):
                return INFER_REPLY.dump_json(outputs)

        gone = threading.Event()  # the client left while its call was prepared: stop between images
        watcher = asyncio.create_task(_watch_disconnect(request, gone))
        try:
            with server.scheduler.arrival():  # a batching engine waits for calls being prepared
                prepared = await run_in_threadpool(prepare)
                ticket = call(server.submit, prepared)
        finally:
            watcher.cancel()
        with times.phase("engine"):
            if ticket is not None:
                try:
                    await server.scheduler.wait_async(ticket, request.is_disconnected)
                except (ValueError, RollmatchError) as exc:
                    raise _http_error(exc) from exc
        payload = await run_in_threadpool(respond, prepared, ticket)
        version = ticket.versions[0] if ticket is not None else server.weight_version
        headers = {
            "X-Weight-Version": str(version),
            SERVER_TIMING_HEADER: format_server_timing(times.seconds),
        }
        return Response(payload, media_type="application/json", headers=headers)

    async def sync_body(
        request: Request, model: type[ModelT], lease: str | None, *, leased: bool = True
    ) -> ModelT:
        """A weight-sync body: the lease checked first (nothing read without it), then the route's
        small body cap, then the body parsed off the event loop under the value cap."""
        if leased:
            call(server.sync.check_lease, lease)
        try:
            raw = await read_body(
                request, max_bytes=server.limits.max_sync_body_bytes, flag="--max-sync-body-bytes"
            )
        except (ValueError, RollmatchError) as exc:
            raise _http_error(exc) from exc
        content_type = request.headers.get("content-type")

        def parse() -> ModelT:
            call(server.limits.check_json_values, raw)
            return parse_json_body(model, raw, content_type)

        return await run_in_threadpool(parse)

    @app.post("/init_communicator/")
    async def init_communicator(
        request: Request, sync_key: str | None = Header(None, alias=SYNC_KEY_HEADER)
    ) -> InitCommunicatorReply:
        call(server.sync.check_sync_key, sync_key)  # from the head: no body read without the key
        body = await sync_body(request, InitCommunicatorBody, None, leased=False)
        requester = request.client.host if request.client else "?"
        return await run_in_threadpool(call, server.init_communicator, body, requester, sync_key)

    @app.post("/update_flattened_params/")
    async def update_flattened_params(
        request: Request, lease: str | None = Header(None, alias=LEASE_HEADER)
    ) -> dict[str, str]:
        body = await sync_body(request, UpdateFlattenedParamsBody, lease)
        await run_in_threadpool(call, server.update_bucket, body, lease)
        return {"message": "receiving bucket"}

    @app.post("/update_adapter_flattened_param/")
    async def update_adapter_flattened_param(
        request: Request, lease: str | None = Header(None, alias=LEASE_HEADER)
    ) -> dict[str, str]:
        body = await sync_body(request, UpdateAdapterBody, lease)
        await run_in_threadpool(call, server.update_bucket, body, lease)
        return {"message": "receiving adapter bucket"}

    @app.post("/finish_weight_update/")
    async def finish_weight_update(
        request: Request, lease: str | None = Header(None, alias=LEASE_HEADER)
    ) -> FinishUpdateReply:
        body = await sync_body(request, FinishUpdateBody, lease)
        return await run_in_threadpool(call, server.finish_update, body, lease)

    @app.post("/reset_prefix_cache/")
    async def reset_prefix_cache(  # waits on the loop: no worker thread held
        lease: str | None = Header(None, alias=LEASE_HEADER),
        sync_key: str | None = Header(None, alias=SYNC_KEY_HEADER),
    ) -> dict[str, str]:
        # A reset drains (or, past the drain timeout, aborts) every call: weight-sync rights, not
        # the API key alone (the lease of the current sync group, or the sync key when one is set).
        call(server.sync.check_lease if lease is not None else server.sync.check_sync_key, lease or sync_key)
        try:
            await server.reset_prefix_cache()
        except (ValueError, RollmatchError) as exc:
            raise _http_error(exc) from exc
        return {"message": "prefix cache reset"}

    @app.post("/close_communicator/")
    def close_communicator(lease: str | None = Header(None, alias=LEASE_HEADER)) -> dict[str, str]:
        closed = call(server.close_communicator, lease)
        return {"message": "communicator closed" if closed else "no communicator to close"}

    return app


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


async def _watch_disconnect(request: Request, gone: threading.Event) -> None:
    """Set ``gone`` once the client disconnects (polled every quarter second until cancelled)."""
    while not await request.is_disconnected():
        await asyncio.sleep(_DISCONNECT_POLL_S)
    gone.set()


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


def _http_error(exc: Exception) -> HTTPException:
    """The answer to an error: its status (see :func:`_status`), with ``Retry-After`` on a 429."""
    if isinstance(exc, ServerBusy):
        retry = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
        return HTTPException(status_code=429, detail=str(exc), headers=retry)
    return HTTPException(status_code=_status(exc), detail=str(exc))


def _status(exc: Exception) -> int:
    """413/422: over a cap; 403: weight sync without the sync key; 409: weight-sync state; 429: the
    server is full for now; 503: the server cannot serve; 400: the request is wrong."""
    if isinstance(exc, RequestTooLarge):
        return exc.status
    if isinstance(exc, SyncKeyRefused):
        return 403
    if isinstance(exc, ServerBusy):
        return 429
    if isinstance(exc, SyncError):
        return 409
    return 503 if isinstance(exc, BackendError) else 400


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    """422 naming each bad field; never echoes the input (it may hold NaN, or megabytes of base64)."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    detail = [
        {
            "loc": [str(part) for part in error.get("loc", ())],
            "msg": str(error.get("msg", "")),
            "type": str(error.get("type", "")),
        }
        for error in errors[:_MAX_ERRORS_SHOWN]
    ]
    summary = "; ".join(f"{'.'.join(item['loc'][1:]) or 'body'}: {item['msg']}" for item in detail)
    more = f" (+{len(errors) - _MAX_ERRORS_SHOWN} more)" if len(errors) > _MAX_ERRORS_SHOWN else ""
    return JSONResponse(
        status_code=422, content={"detail": detail, "error": f"invalid request: {summary}{more}"}
    )
