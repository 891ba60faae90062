"""``rollmatch serve``: the HTTP rollout server (ms-swift ``swift rollout`` compatible) + weight sync.

Owns: :class:`RolloutServer` (the weight version, the weight-sync group and its receiver, counters,
and the lock that keeps a weight load from interleaving with generation), :func:`build_app` (the
FastAPI routes) and :func:`serve_command`. Leaves out: engines (``server.engines``), wire shapes
(``rollmatch.protocol``) and the update transaction (``sync.transaction``).

Endpoints: ``GET /health/ /get_world_size/ /info/ /stats/``; ``POST /infer/ /init_communicator/
/update_flattened_params/ /update_adapter_flattened_param/ /finish_weight_update/
/reset_prefix_cache/ /close_communicator/ /get_engine_type/``. Errors answer ``400`` (bad request),
``409`` (weight-sync state) or ``503`` (cannot serve) with one message in ``detail``.

Concurrency: a weight load waits for in-flight generations and blocks new ones until it is done, so
the ``weight_version`` of every response is exact. Bucket receives run beside generation.
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections import Counter
from typing import Any

from fastapi import FastAPI, HTTPException, Response

from rollmatch.errors import BackendError, CollectiveTimeoutError, RollmatchError, SyncError
from rollmatch.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatMessage,
    FinishUpdateBody,
    FinishUpdateReply,
    InferBody,
    InitCommunicatorBody,
    RequestConfig,
    RolloutOutput,
    ServerInfo,
    ServerStats,
    UpdateAdapterBody,
    UpdateFlattenedParamsBody,
    Usage,
    decoding_from_request_config,
)
from rollmatch.server.engines import ServerEngine, build_engine
from rollmatch.sync.transaction import AdapterPayload, UpdateReceiver, VerifiedUpdate
from rollmatch.sync.transport import GroupTransport

log = logging.getLogger(__name__)


class RolloutServer:
    """The server's state; every public method is one endpoint's behaviour (HTTP-free, testable)."""

    def __init__(self, engine: ServerEngine):
        self.engine = engine
        self.weight_version = 0
        self._engine_lock = threading.Lock()  # generation vs. weight load
        self._sync_lock = threading.Lock()  # communicator and update state
        self._transport: GroupTransport | None = None
        self._receiver: UpdateReceiver | None = None
        self._init_thread: threading.Thread | None = None
        self._init_error: str | None = None
        self.pushes_by_version: Counter[int] = Counter()
        self.failed_pushes = 0
        self.infer_requests = 0
        self.infer_calls = 0
        self.broken: str | None = None  # set when a weight load failed half-way: never serve mixed weights

    def _require_healthy(self) -> None:
        if self.broken is not None:
            raise BackendError(f"this rollout server stopped serving: {self.broken}; restart it")

    # ------------------------------------------------------------------------------- inference
    def infer(self, body: InferBody) -> list[RolloutOutput]:
        self._require_healthy()
        config = body.request_config or RequestConfig()
        if config.stop:
            raise ValueError(
                f"request_config.stop = {config.stop!r}: rollouts always stop at <|im_end|>; stop strings are not "
                "supported (send an empty list)"
            )
        prompts = [self.engine.preparer.prepare(req, i) for i, req in enumerate(body.infer_requests)]
        if not prompts:
            return []
        longest = max(len(p.prompt_token_ids) for p in prompts)
        decoding = decoding_from_request_config(config, self.engine.max_model_len - longest)
        with self._engine_lock:
            version = self.weight_version
            outputs = self.engine.generate(prompts, decoding, config.seed)
            self.infer_calls += 1
            self.infer_requests += len(prompts)
        details = config.return_details
        return [
            RolloutOutput(
                response=ChatCompletionResponse(
                    model=self.engine.model_dir,
                    choices=[
                        ChatChoice(
                            index=0,
                            message=ChatMessage(content=out.text),
                            finish_reason=out.finish_reason,
                            token_ids=out.token_ids if details else None,
                        )
                    ],
                    usage=Usage(
                        prompt_tokens=len(out.prompt_token_ids),
                        completion_tokens=len(out.token_ids),
                        total_tokens=len(out.prompt_token_ids) + len(out.token_ids),
                    ),
                    prompt_token_ids=out.prompt_token_ids if details else None,
                ),
                response_token_ids=[out.token_ids] if details else [],
                rollout_infos={"weight_version": version},
                weight_version=version,
                sample_id=prompt.sample_id,
            )
            for prompt, out in zip(prompts, outputs, strict=True)
        ]

    def reset_prefix_cache(self) -> None:
        with self._engine_lock:
            self.engine.reset_caches()

    # ---------------------------------------------------------------------------- weight sync
    def init_communicator(self, body: InitCommunicatorBody) -> None:
        """Start forming the group in the background (the trainer joins right after this returns)."""
        expected = self.engine.world_size + 1
        if body.world_size != expected:
            raise SyncError(
                f"init_communicator world_size {body.world_size}: this server has {self.engine.world_size} "
                f"receiving rank(s), so the group has {expected} (trainer = last rank)"
            )
        with self._sync_lock:
            if self._init_thread is not None and self._init_thread.is_alive():
                raise SyncError(
                    "a previous init_communicator is still waiting for its trainer; retry after its timeout"
                )
            self._close_locked()
            self._init_error = None
            self._init_thread = threading.Thread(target=self._form_group, args=(body,), daemon=True)
            self._init_thread.start()

    def _form_group(self, body: InitCommunicatorBody) -> None:
        device = "cuda" if body.backend == "nccl" else "cpu"
        try:
            # Rank 0 hosts the store on this machine's interfaces at the requested port.
            transport = GroupTransport(
                host="0.0.0.0",
                port=body.port,
                rank=0,
                world_size=body.world_size,
                backend=body.backend,
                timeout_s=body.timeout_s,
                device=device,
            )
        except RollmatchError as exc:
            self._init_error = str(exc)
            log.error("weight-sync group failed: %s", exc)
            return
        with self._sync_lock:
            self._transport = transport
            self._receiver = UpdateReceiver(transport, source_rank=body.world_size - 1, device=device)

    def _ready_receiver(self) -> UpdateReceiver:
        thread = self._init_thread
        if thread is not None:
            thread.join(timeout=30.0)  # the trainer joined already; this is the last handshake step
        if self._receiver is None:
            reason = self._init_error or "no communicator: POST /init_communicator/ first"
            raise SyncError(f"weight update refused: {reason}")
        return self._receiver

    def update_bucket(self, body: UpdateFlattenedParamsBody | UpdateAdapterBody) -> None:
        if body.transaction is None:
            raise SyncError(
                "weight updates need a `transaction` header (version, mode, bucket_index, num_bytes) and end with "
                "POST /finish_weight_update/; untracked swift-style updates are not accepted"
            )
        adapter = None
        if isinstance(body, UpdateAdapterBody):
            if "adapter" not in self.engine.sync_modes:
                raise SyncError(f"the {self.engine.name} engine does not serve adapters; use sync.mode: full")
            adapter = AdapterPayload(peft_config=body.peft_config, lora_int_id=body.lora_int_id)
        receiver = self._ready_receiver()
        with self._sync_lock:
            receiver.receive_bucket(body.transaction, body.metadatas, adapter)

    def finish_update(self, body: FinishUpdateBody) -> FinishUpdateReply:
        """Verify the staged update, load it, then acknowledge; any rejection keeps the old version."""
        self._require_healthy()
        receiver = self._ready_receiver()
        with self._sync_lock:
            try:
                update = receiver.finish(body)
                with self._engine_lock:
                    self._load(update)
            except (SyncError, CollectiveTimeoutError) as exc:
                self.failed_pushes += 1
                log.error("weight version %s rejected: %s", body.version, exc)
                return FinishUpdateReply(
                    ok=False,
                    version=self.weight_version,
                    checksum="",
                    bucket_checksums=[],
                    num_bytes=0,
                    num_tensors=0,
                    error=str(exc),
                )
            self.pushes_by_version[update.version] += 1
            return update.reply

    def _load(self, update: VerifiedUpdate) -> None:
        """Engines validate names and shapes before changing anything (a ``SyncError`` is clean)."""
        if update.adapter is not None:
            try:
                self.engine.load_adapter(update.tensors, update.adapter)
            except BackendError as exc:  # the previous adapter is still the one served
                raise SyncError(f"adapter of version {update.version} could not be loaded: {exc}") from exc
        else:
            try:
                self.engine.load_weights(update.tensors)
            except SyncError:
                raise
            except Exception as exc:  # a half-applied load: mark the server broken, then report
                self.broken = (
                    f"loading weight version {update.version} failed half-way ({type(exc).__name__}: {exc})"
                )
                raise BackendError(self.broken) from exc
        self.engine.reset_caches()
        self.weight_version = update.version

    def close_communicator(self) -> None:
        with self._sync_lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
        if self._transport is not None:
            self._transport.close()
        self._transport, self._receiver = None, None

    # ----------------------------------------------------------------------------------- facts
    def info(self) -> ServerInfo:
        engine = self.engine
        return ServerInfo(
            engine=engine.name,
            model_dir=engine.model_dir,
            fingerprint=engine.fingerprint,
            dtype=engine.dtype,
            max_model_len=engine.max_model_len,
            world_size=engine.world_size,
            weight_version=self.weight_version,
            sync_modes=list(engine.sync_modes),
        )

    def stats(self) -> ServerStats:
        if self._receiver is not None:
            communicator = "ready"
        elif self._init_thread is not None and self._init_thread.is_alive():
            communicator = "initializing"
        else:
            communicator = f"failed: {self._init_error}" if self._init_error else "none"
        return ServerStats(
            weight_version=self.weight_version,
            pushes_by_version=dict(self.pushes_by_version),
            failed_pushes=self.failed_pushes,
            infer_requests=self.infer_requests,
            infer_calls=self.infer_calls,
            communicator=communicator,
        )

    def close(self) -> None:
        self.close_communicator()
        self.engine.close()


def build_app(server: RolloutServer) -> FastAPI:
    """The FastAPI app: thin routes over :class:`RolloutServer` (sync handlers run in a thread pool)."""
    app = FastAPI(title="rollmatch rollout server")

    def call(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except (ValueError, RollmatchError) as exc:
            raise HTTPException(status_code=_status(exc), detail=str(exc)) from exc

    @app.get("/health/")
    def health(response: Response) -> dict[str, str]:
        if server.broken is not None:
            response.status_code = 503
            return {"status": "broken", "detail": server.broken}
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
    def init_communicator(body: InitCommunicatorBody) -> dict[str, str]:
        call(server.init_communicator, body)
        return {"message": "initializing communicator"}

    @app.post("/update_flattened_params/")
    def update_flattened_params(body: UpdateFlattenedParamsBody) -> dict[str, str]:
        call(server.update_bucket, body)
        return {"message": "receiving bucket"}

    @app.post("/update_adapter_flattened_param/")
    def update_adapter_flattened_param(body: UpdateAdapterBody) -> dict[str, str]:
        call(server.update_bucket, body)
        return {"message": "receiving adapter bucket"}

    @app.post("/finish_weight_update/")
    def finish_weight_update(body: FinishUpdateBody) -> FinishUpdateReply:
        return call(server.finish_update, body)

    @app.post("/reset_prefix_cache/")
    def reset_prefix_cache() -> dict[str, str]:
        call(server.reset_prefix_cache)
        return {"message": "prefix cache reset"}

    @app.post("/close_communicator/")
    def close_communicator() -> dict[str, str]:
        call(server.close_communicator)
        return {"message": "communicator closed"}

    return app


def _status(exc: Exception) -> int:
    """409: weight-sync state; 503: the server cannot serve; 400: the request is wrong."""
    if isinstance(exc, SyncError):
        return 409
    return 503 if isinstance(exc, BackendError) else 400


def serve_command(args: argparse.Namespace) -> int:
    """``rollmatch serve``: load the engine, then serve until interrupted."""
    import torch
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = build_engine(
        args.engine,
        args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        enable_lora=bool(getattr(args, "enable_lora", False)),
        min_pixels=getattr(args, "min_pixels", None),
        max_pixels=getattr(args, "max_pixels", None),
    )
    server = RolloutServer(engine)
    log.info(
        "rollout server (%s engine, %s) on http://%s:%d; picked for this machine: device %s, dtype %s, "
        "max_model_len %d, tensor_parallel_size %d (flags --dtype, --max-model-len, --tensor-parallel-size)",
        engine.name,
        args.model,
        args.host,
        args.port,
        "cuda" if torch.cuda.is_available() else "cpu",
        args.dtype,
        args.max_model_len,
        args.tensor_parallel_size,
    )
    try:
        uvicorn.run(build_app(server), host=args.host, port=args.port, log_level="warning")
    finally:
        server.close()
    return 0
