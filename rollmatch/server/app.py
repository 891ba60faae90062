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
``/update_adapter_flattened_param/``, ``/finish_weight_update/`` (these need the lease in
``X-Rollmatch-Sync-Lease``), ``/reset_prefix_cache/``, ``/close_communicator/``.
Synchronous handlers run in the thread pool, so health probes answer during generation.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Header, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from rollmatch.errors import BackendError, RollmatchError, SyncError
from rollmatch.protocol import (
    FinishUpdateBody,
    FinishUpdateReply,
    InferBody,
    InitCommunicatorBody,
    RolloutOutput,
    ServerInfo,
    ServerStats,
    UpdateAdapterBody,
    UpdateFlattenedParamsBody,
)
from rollmatch.server.gate import RequestGate
from rollmatch.server.limits import RequestTooLarge
from rollmatch.server.rollout_server import RolloutServer
from rollmatch.server.sync_session import LEASE_HEADER

log = logging.getLogger(__name__)
_MAX_ERRORS_SHOWN = 8


def build_app(server: RolloutServer, *, api_key: str | None = None) -> FastAPI:
    """The FastAPI app over ``server``; ``api_key`` (``None``: open) guards every POST."""
    app = FastAPI(title="rollmatch rollout server")
    app.add_middleware(RequestGate, api_key=api_key, max_body_bytes=server.limits.max_body_bytes)
    app.add_exception_handler(RequestValidationError, _validation_error)

    def call(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except (ValueError, RollmatchError) as exc:
            raise HTTPException(status_code=_status(exc), detail=str(exc)) from exc

    @app.get("/health/")
    def health(response: Response) -> dict[str, str]:
        reason = server.unhealthy()
        if reason is not None:
            response.status_code = 503
            return {"status": "stalled" if server.broken is None else "broken", "detail": reason}
        return {"status": "ok"}

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
    def info() -> ServerInfo:
        return server.info()

    @app.get("/stats/")
    def stats() -> ServerStats:
        return server.stats()

    @app.post("/infer/")
    def infer(body: InferBody, response: Response) -> list[RolloutOutput]:
        outputs = call(server.infer, body)
        response.headers["X-Weight-Version"] = str(server.weight_version)
        return outputs

    @app.post("/init_communicator/")
    def init_communicator(body: InitCommunicatorBody, request: Request) -> dict[str, str]:
        requester = request.client.host if request.client else "?"
        lease = call(server.init_communicator, body, requester)
        return {"message": "initializing communicator", "lease": lease}

    @app.post("/update_flattened_params/")
    def update_flattened_params(
        body: UpdateFlattenedParamsBody, lease: str | None = Header(None, alias=LEASE_HEADER)
    ) -> dict[str, str]:
        call(server.update_bucket, body, lease)
        return {"message": "receiving bucket"}

    @app.post("/update_adapter_flattened_param/")
    def update_adapter_flattened_param(
        body: UpdateAdapterBody, lease: str | None = Header(None, alias=LEASE_HEADER)
    ) -> dict[str, str]:
        call(server.update_bucket, body, lease)
        return {"message": "receiving adapter bucket"}

    @app.post("/finish_weight_update/")
    def finish_weight_update(
        body: FinishUpdateBody, lease: str | None = Header(None, alias=LEASE_HEADER)
    ) -> FinishUpdateReply:
        return call(server.finish_update, body, lease)

    @app.post("/reset_prefix_cache/")
    def reset_prefix_cache() -> dict[str, str]:
        call(server.reset_prefix_cache)
        return {"message": "prefix cache reset"}

    @app.post("/close_communicator/")
    def close_communicator(lease: str | None = Header(None, alias=LEASE_HEADER)) -> dict[str, str]:
        call(server.close_communicator, lease)
        return {"message": "communicator closed"}

    return app


def _status(exc: Exception) -> int:
    """413/422: over a cap; 409: weight-sync state; 503: the server cannot serve; 400: the request is wrong."""
    if isinstance(exc, RequestTooLarge):
        return exc.status
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
