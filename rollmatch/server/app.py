"""The rollout server's HTTP surface (ms-swift ``swift rollout`` compatible): routes and error answers.

Owns: :func:`build_app`: thin FastAPI routes over :class:`~rollmatch.server.rollout_server.RolloutServer`
behind the :class:`~rollmatch.server.gate.RequestGate` (token, body size), and the mapping of every
error to one 4xx/5xx answer that names the field or the fix. A malformed request is always a 4xx:
validation errors are rendered without echoing the input (NaN / Infinity in a body cannot break
the answer), ``ValueError`` is a 400, a value over a cap a 413/422, weight-sync state a 409, an
unusable engine a 503 (one exception handler for every route). Leaves out: behaviour, the
``/infer/`` flow included (``server.rollout_server``), and the process (``server.serve``).

Endpoints: ``GET /health/`` (503 when a weight load failed half-way or the engine is stalled),
``/get_world_size/``, ``/info/``, ``/stats/``; ``POST /infer/``, ``/get_engine_type/``,
``/init_communicator/`` (returns the sync lease), ``/update_flattened_params/``,
``/update_adapter_flattened_param/``, ``/finish_weight_update/``, ``/close_communicator/`` (these
need the lease in ``X-Rollmatch-Sync-Lease``; ``/init_communicator/`` needs the sync key in
``X-Rollmatch-Sync-Key`` when the server has one: 403 without), ``/reset_prefix_cache/`` (the
lease, or the sync key when the server has one; a no-op on an engine without a prefix cache).
``/health/``, ``/info/`` and ``/stats/`` are ``async`` routes that read lock-free state on the event
loop: they never wait for the engine or for a worker thread (``/health/`` gives the reason behind a
503 only to a caller with the key). ``/infer/`` hands the server its body reader and disconnect probe
and answers what :meth:`~rollmatch.server.rollout_server.RolloutServer.infer` returns (the flow:
receive, validate, admit, schedule, respond, with no thread held while a call queues). The
weight-sync routes check the lease from the head, then read the body under
``--max-sync-body-bytes`` and parse it in a worker thread. A full server answers 429 with
``Retry-After``. The answer carries the weight version (``X-Weight-Version``, the oldest when
``keep`` mode mixed two) and the phase times in a ``Server-Timing`` header (``receive``, ``parse``,
``prepare``, ``decode``, ``preprocess``, ``engine``, ``outputs``, ``respond``).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Header, HTTPException, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from rollmatch.errors import BackendError, RollmatchError, ServerBusy, SyncError
from rollmatch.protocol import (
    LEASE_HEADER,
    SERVER_TIMING_HEADER,
    SYNC_KEY_HEADER,
    FinishUpdateBody,
    FinishUpdateReply,
    InitCommunicatorBody,
    InitCommunicatorReply,
    ServerHealth,
    ServerInfo,
    ServerStats,
    UpdateAdapterBody,
    UpdateFlattenedParamsBody,
    format_server_timing,
)
from rollmatch.server.bodies import BodyLease, ModelT, parse_json_body, read_body
from rollmatch.server.gate import AUTHENTICATED, RequestGate
from rollmatch.server.limits import RequestTooLarge
from rollmatch.server.rollout_server import InferCall, RolloutServer
from rollmatch.server.sync_session import SyncKeyRefused

log = logging.getLogger(__name__)
_MAX_ERRORS_SHOWN = 8


def build_app(server: RolloutServer, *, api_key: str | None = None) -> FastAPI:
    """The FastAPI app over ``server``; ``api_key`` (``None``: open) guards every route, the API docs
    included, but ``GET /health/`` (see :mod:`rollmatch.server.gate`)."""
    app = FastAPI(title="rollmatch rollout server")
    app.add_middleware(RequestGate, api_key=api_key, max_body_bytes=server.limits.max_body_bytes)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ValueError, _error_answer)  # every route's errors: one answer each
    app.add_exception_handler(RollmatchError, _error_answer)

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
        return {"world_size": server.world_size()}

    @app.post("/get_engine_type/")
    def get_engine_type() -> dict[str, Any]:
        return server.engine_type()

    @app.get("/info/")
    async def info() -> ServerInfo:
        return server.info()

    @app.get("/stats/")
    async def stats() -> ServerStats:
        return server.stats()

    @app.post("/infer/")
    async def infer(request: Request) -> Response:
        async def body(lease: BodyLease) -> bytes:
            return await read_body(
                request, max_bytes=server.limits.max_body_bytes, flag="--max-body-bytes", lease=lease
            )

        call = InferCall(body, request.headers.get("content-type"), request.is_disconnected)
        answer = await server.infer(call)
        headers = {
            "X-Weight-Version": str(answer.weight_version),
            SERVER_TIMING_HEADER: format_server_timing(answer.phase_seconds),
        }
        return Response(answer.payload, media_type="application/json", headers=headers)

    async def sync_body(
        request: Request, model: type[ModelT], lease: str | None, *, leased: bool = True
    ) -> ModelT:
        """A weight-sync body: the lease checked first (nothing read without it), then the route's
        small body cap, then the body parsed off the event loop under the value cap."""
        if leased:
            server.check_lease(lease)
        raw = await read_body(
            request, max_bytes=server.limits.max_sync_body_bytes, flag="--max-sync-body-bytes"
        )
        content_type = request.headers.get("content-type")

        def parse() -> ModelT:
            server.limits.check_json_values(raw)
            return parse_json_body(model, raw, content_type)

        return await run_in_threadpool(parse)

    @app.post("/init_communicator/")
    async def init_communicator(
        request: Request, sync_key: str | None = Header(None, alias=SYNC_KEY_HEADER)
    ) -> InitCommunicatorReply:
        server.check_sync_key(sync_key)  # from the head: no body read without the key
        body = await sync_body(request, InitCommunicatorBody, None, leased=False)
        requester = request.client.host if request.client else "?"
        return await run_in_threadpool(server.init_communicator, body, requester, sync_key)

    @app.post("/update_flattened_params/")
    async def update_flattened_params(
        request: Request, lease: str | None = Header(None, alias=LEASE_HEADER)
    ) -> dict[str, str]:
        body = await sync_body(request, UpdateFlattenedParamsBody, lease)
        await run_in_threadpool(server.update_bucket, body, lease)
        return {"message": "receiving bucket"}

    @app.post("/update_adapter_flattened_param/")
    async def update_adapter_flattened_param(
        request: Request, lease: str | None = Header(None, alias=LEASE_HEADER)
    ) -> dict[str, str]:
        body = await sync_body(request, UpdateAdapterBody, lease)
        await run_in_threadpool(server.update_bucket, body, lease)
        return {"message": "receiving adapter bucket"}

    @app.post("/finish_weight_update/")
    async def finish_weight_update(
        request: Request, lease: str | None = Header(None, alias=LEASE_HEADER)
    ) -> FinishUpdateReply:
        body = await sync_body(request, FinishUpdateBody, lease)
        return await run_in_threadpool(server.finish_update, body, lease)

    @app.post("/reset_prefix_cache/")
    async def reset_prefix_cache(  # waits on the loop: no worker thread held
        lease: str | None = Header(None, alias=LEASE_HEADER),
        sync_key: str | None = Header(None, alias=SYNC_KEY_HEADER),
    ) -> dict[str, str]:
        # A reset drains (or, past the drain timeout, aborts) every call: weight-sync rights, not
        # the API key alone (the lease of the current sync group, or the sync key when one is set).
        if lease is not None:
            server.check_lease(lease)
        else:
            server.check_sync_key(sync_key)
        await server.reset_prefix_cache()
        return {"message": "prefix cache reset"}

    @app.post("/close_communicator/")
    def close_communicator(lease: str | None = Header(None, alias=LEASE_HEADER)) -> dict[str, str]:
        closed = server.close_communicator(lease)
        return {"message": "communicator closed" if closed else "no communicator to close"}

    return app


async def _error_answer(request: Request, exc: Exception) -> Response:
    """A ``ValueError`` or rollmatch error of any route, answered as :func:`_http_error` maps it."""
    return await http_exception_handler(request, _http_error(exc))


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
