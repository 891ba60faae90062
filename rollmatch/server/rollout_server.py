"""The rollout server's behaviour, HTTP-free: inference, weight loads, health, counters.

Owns: :class:`RolloutServer`: the weight version, the engine behind its :class:`EngineGuard`
(generation and weight loads never interleave; a stalled generation makes the server unhealthy),
request checks against the server's caps (:class:`~rollmatch.server.limits.ServerLimits`), stop
strings, and the recovery of the engine after any failed generation (no request left queued, caches
reset), so one bad request never wedges the engine for the next. Leaves out: HTTP
(``server.app``), request preparation (``server.prompts``) and the weight-sync group
(``server.sync_session``).
"""

from __future__ import annotations

import logging
import threading

from rollmatch.errors import BackendError, SyncError
from rollmatch.protocol import (
    SEED_MAX,
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
from rollmatch.server.engines import EngineOutput, ServerEngine
from rollmatch.server.limits import RequestTooLarge, ServerLimits
from rollmatch.server.prompts import PreparedPrompt, trim_at_stop_strings
from rollmatch.server.sync_session import SyncSession
from rollmatch.server.timing import PhaseTimes
from rollmatch.server.watchdog import GENERATION, EngineGuard
from rollmatch.sync.transaction import VerifiedUpdate

log = logging.getLogger(__name__)


class RolloutServer:
    """The server's state; every public method is one endpoint's behaviour (HTTP-free, testable)."""

    def __init__(self, engine: ServerEngine, limits: ServerLimits | None = None):
        self.engine = engine
        self.limits = limits or ServerLimits()
        self.weight_version = 0
        self.guard = EngineGuard(self.limits.engine_stall_timeout_s)
        engine.observe_progress(self.guard.progress)
        self.sync = SyncSession(engine.world_size, "adapter" in engine.sync_modes)
        self._counter_lock = threading.Lock()
        self.pushes_by_version: dict[int, int] = {}
        self.infer_requests = 0
        self.infer_calls = 0
        self.rejected_requests = 0
        self.broken: str | None = None  # set when a weight load failed half-way: never serve mixed weights

    def unhealthy(self) -> str | None:
        """Why the server cannot serve (a half-applied load, a stalled engine), or ``None``."""
        if self.broken is not None:
            return self.broken
        stalled = self.guard.stalled()
        return f"the rollout engine is stalled: {stalled}" if stalled else None

    # ------------------------------------------------------------------------------- inference
    def infer(self, body: InferBody, times: PhaseTimes | None = None) -> list[RolloutOutput]:
        """Roll out every request of ``body``; ``times`` (optional) gets the phases ``prepare`` (caps,
        id checks; ``decode`` for the images inside it), ``engine`` (with any wait for the engine
        lock) and ``outputs``."""
        times = times if times is not None else PhaseTimes()
        if self.broken is not None:
            raise BackendError(f"this rollout server stopped serving: {self.broken}; restart it")
        try:
            with times.phase("prepare"):
                config, prompts = self._checked(body, times)
        except ValueError:
            self._count(rejected=1)
            raise
        if not prompts:
            return []
        longest = max(len(p.prompt_token_ids) for p in prompts)
        if longest >= self.engine.max_model_len:
            self._count(rejected=1)
            raise ValueError(
                f"prompt too long: a prompt of {longest} tokens leaves no room for new tokens within the server's "
                f"max_model_len of {self.engine.max_model_len}; shorten it or serve with a larger --max-model-len"
            )
        decoding = decoding_from_request_config(
            config, self.engine.max_model_len - longest, self.limits.max_tokens
        )
        with times.phase("engine"), self.guard.hold(GENERATION):
            version = self.weight_version
            try:
                outputs = self.engine.generate(prompts, decoding, config.seed)
            except Exception as exc:  # any failure: leave the engine clean for the next request, then report
                self.engine.recover()
                raise _engine_failure(exc) from exc
        self._count(calls=1, requests=len(prompts))
        with times.phase("outputs"):
            if config.stop:
                outputs = [self._apply_stops(out, config.stop) for out in outputs]
            return [
                _rollout_output(self.engine.model_dir, p, out, version, config.return_details)
                for p, out in zip(prompts, outputs, strict=True)
            ]

    def _checked(self, body: InferBody, times: PhaseTimes) -> tuple[RequestConfig, list[PreparedPrompt]]:
        """Caps and cross-field checks the wire models cannot know; then the prepared prompts."""
        config = body.request_config or RequestConfig()
        count = len(body.infer_requests)
        if count > self.limits.max_requests_per_call:
            raise RequestTooLarge(
                "infer_requests",
                f"infer_requests holds {count} requests, over this server's limit of "
                f"{self.limits.max_requests_per_call} per call (rollmatch serve --max-requests-per-call); "
                "split the call",
            )
        if config.max_tokens is not None and config.max_tokens > self.limits.max_tokens:
            raise RequestTooLarge(
                "request_config.max_tokens",
                f"request_config.max_tokens = {config.max_tokens} is over this server's cap of "
                f"{self.limits.max_tokens} new tokens (rollmatch serve --max-tokens)",
                status=422,
            )
        if config.seed is not None and config.seed + max(count - 1, 0) > SEED_MAX:
            raise ValueError(
                f"request_config.seed = {config.seed}: request j samples with seed + j, which must stay within "
                f"[0, 2**63 - 1] for all {count} requests; send a smaller seed"
            )
        vocab = self.engine.preparer.vocab_size
        if config.top_k is not None and config.top_k > vocab:
            raise ValueError(
                f"request_config.top_k = {config.top_k} is larger than the vocabulary ({vocab}); send -1 to disable"
            )
        prepare = self.engine.preparer.prepare
        return config, [prepare(r, i, times) for i, r in enumerate(body.infer_requests)]

    def _apply_stops(self, out: EngineOutput, stops: list[str]) -> EngineOutput:
        trimmed = trim_at_stop_strings(out.token_ids, out.text, stops, self.engine.preparer.tokenizer)
        if trimmed is None:
            return out
        return EngineOutput(out.prompt_token_ids, trimmed[0], trimmed[1], "stop")

    def reset_prefix_cache(self) -> None:
        with self.guard.hold("cache reset"):
            self.engine.reset_caches()

    def _count(self, *, calls: int = 0, requests: int = 0, rejected: int = 0) -> None:
        with self._counter_lock:
            self.infer_calls += calls
            self.infer_requests += requests
            self.rejected_requests += rejected

    # ---------------------------------------------------------------------------- weight sync
    def init_communicator(self, body: InitCommunicatorBody, requester: str = "?") -> str:
        """Start forming the weight-sync group; returns the sync lease the trainer must send."""
        return self.sync.init(body, requester)

    def update_bucket(self, body: UpdateFlattenedParamsBody | UpdateAdapterBody, lease: str | None) -> None:
        self.sync.receive_bucket(body, lease)

    def finish_update(self, body: FinishUpdateBody, lease: str | None) -> FinishUpdateReply:
        """Verify the staged update, load it, then acknowledge; any rejection keeps the old version."""
        if self.broken is not None:
            raise BackendError(f"this rollout server stopped serving: {self.broken}; restart it")
        replies: list[FinishUpdateReply] = []

        def load(update: VerifiedUpdate) -> None:
            with self.guard.hold("weight load"):
                self._load(update)
            replies.append(update.reply)

        rejected = self.sync.finish(body, lease, load)
        if rejected is not None:
            return FinishUpdateReply(
                ok=False,
                version=self.weight_version,
                checksum="",
                bucket_checksums=[],
                num_bytes=0,
                num_tensors=0,
                error=rejected,
            )
        reply = replies[0]
        with self._counter_lock:
            self.pushes_by_version[reply.version] = self.pushes_by_version.get(reply.version, 0) + 1
        return reply

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

    def close_communicator(self, lease: str | None = None) -> None:
        self.sync.close(lease)

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
        return ServerStats(
            weight_version=self.weight_version,
            pushes_by_version=dict(self.pushes_by_version),
            failed_pushes=self.sync.failed_pushes,
            abandoned_pushes=self.sync.abandoned_pushes,
            infer_requests=self.infer_requests,
            infer_calls=self.infer_calls,
            rejected_requests=self.rejected_requests,
            communicator=self.sync.describe(),
        )

    def close(self) -> None:
        self.sync.shutdown()
        self.engine.close()


def _engine_failure(exc: Exception) -> Exception:
    """What a failed generation reports: the engine refusing this request's values is the client's
    problem (400); anything else is the engine's (503). Either way the engine was recovered."""
    if isinstance(exc, ValueError | TypeError | OverflowError):
        return ValueError(
            f"the engine refused the request ({type(exc).__name__}: {exc}); nothing was generated"
        )
    if isinstance(exc, BackendError):
        return exc
    return BackendError(
        f"generation failed ({type(exc).__name__}: {exc}); the engine was reset and keeps serving"
    )


def _rollout_output(
    model: str, prompt: PreparedPrompt, out: EngineOutput, version: int, details: bool
) -> RolloutOutput:
    return RolloutOutput(
        response=ChatCompletionResponse(
            model=model,
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
