"""The rollout server's behaviour behind its routes: the ``/infer/`` flow, weight loads, health, counters.

Owns: :class:`RolloutServer`: the ``/infer/`` flow end to end (:meth:`RolloutServer.infer`), the
weight version, health, and the glue between calls and weight syncs and the
:class:`~rollmatch.server.scheduler.EngineScheduler` that runs them on the engine (continuous batching
across calls, fair weight updates, a watchdog on every engine operation). A failed generation leaves
the engine clean for the next request. Leaves out: HTTP routes and error answers (``server.app``),
a call's checks (``server.infer_checks``), its reply items (``server.infer_replies``), request
preparation (``server.prompt_preparer``), the engine thread (``server.scheduler``) and the
weight-sync group (``server.sync_session``).

``/infer/`` (:meth:`RolloutServer.infer`) reads top-down: **receive** (the body under the in-flight
body budget) -> **validate** (a worker thread: the raw bytes' caps, the JSON, then :meth:`prepare`:
caps, prompt ids, images decoded) -> **admit** (:meth:`submit`: 429 when the server holds too much)
-> **schedule** (wait for the engine on the event loop, no thread held, the call cancelled when its
client leaves) -> **respond** (:meth:`outputs` serialised in a second worker-thread hop, with the
weight version and the phase times).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from fastapi.concurrency import run_in_threadpool

from rollmatch.config.decoding import Decoding
from rollmatch.data.prompts import PROBE_IMAGE_SIZE, image_probe
from rollmatch.detection.coord_tokens import supported_object_formats
from rollmatch.errors import BackendError, ServerBusy, SyncError
from rollmatch.protocol import (
    INFER_REPLY,
    FinishUpdateBody,
    FinishUpdateReply,
    ImageProbe,
    InferBody,
    InitCommunicatorBody,
    InitCommunicatorReply,
    RequestConfig,
    RolloutOutput,
    ServerHealth,
    ServerInfo,
    ServerStats,
    UpdateAdapterBody,
    UpdateFlattenedParamsBody,
    decoding_from_request_config,
)
from rollmatch.server.bodies import BodyBudget, BodyLease, parse_json_body
from rollmatch.server.engine_watch import WEIGHT_LOAD, EngineWatch
from rollmatch.server.engines import ServerEngine, check_weight_coverage
from rollmatch.server.infer_checks import InferChecks, engine_failure
from rollmatch.server.infer_replies import apply_stops, rollout_output
from rollmatch.server.limits import RequestTooLarge, ServerLimits
from rollmatch.server.media import PixelBudget, PixelLease, TensorBudget
from rollmatch.server.prompt_preparer import PreparedPrompt
from rollmatch.server.scheduler import CallTicket, EngineScheduler
from rollmatch.server.sync_session import SyncSession
from rollmatch.server.timing import PhaseTimes
from rollmatch.sync.transaction import VerifiedUpdate

log = logging.getLogger(__name__)
_DISCONNECT_POLL_S = 0.25


@dataclass(frozen=True)
class InferCall:
    """One ``/infer/`` call as the HTTP layer hands it over: how to read its body (into a lease of the
    in-flight body budget, under the route's cap), its content type, and whether its client left."""

    read_body: Callable[[BodyLease], Awaitable[bytes]]
    content_type: str | None
    is_disconnected: Callable[[], Awaitable[bool]]


@dataclass(frozen=True)
class InferAnswer:
    """What ``/infer/`` answers: the reply items as JSON bytes, the weight version that produced them
    (the oldest, when the ``keep`` update mode mixed two) and the seconds of each phase."""

    payload: bytes
    weight_version: int
    phase_seconds: dict[str, float]


@dataclass
class PreparedCall:
    """One ``/infer/`` call checked and ready for the engine."""

    config: RequestConfig
    prompts: list[PreparedPrompt]
    decoding: Decoding | None  # None: nothing to generate (no prompts)
    pixels: PixelLease | None = None  # its decoded images' pixels, held until the engine is done with them

    def release(self) -> None:
        """Give back the decoded pixels the call holds (idempotent)."""
        if self.pixels is not None:
            self.pixels.release()


class RolloutServer:
    """The server's state; every public method is one endpoint's behaviour (no routes: testable without
    HTTP; the ``/infer/`` flow takes its body and disconnect probe as callables)."""

    def __init__(
        self,
        engine: ServerEngine,
        limits: ServerLimits | None = None,
        *,
        coord_frame: str | None = None,
        sync_key: str | None = None,
    ):
        self.engine = engine
        self.coord_frame = coord_frame  # reported by /info/ (resolved by `rollmatch serve`), not used here
        resized, tokens = image_probe(engine.preparer.processor)
        self._probe = ImageProbe(size=PROBE_IMAGE_SIZE, resized=resized, image_tokens=tokens)
        self.limits = limits or ServerLimits()
        self.pixels = PixelBudget(self.limits.max_call_pixels, self.limits.max_inflight_pixels)
        self.tensors = TensorBudget(self.limits.max_call_tensor_bytes, self.limits.max_inflight_tensor_bytes)
        self.bodies = BodyBudget(self.limits.max_inflight_body_bytes)
        self._preparing_prompts = 0  # prompts of calls between their parse and their submission
        self.watch = EngineWatch(self.limits.engine_stall_timeout_s)
        engine.observe_progress(self.watch.progress)
        self.scheduler = EngineScheduler(engine, self.watch, self.limits, on_failure=engine_failure)
        self.checks = InferChecks(engine, self.limits, self.pixels, self.tensors)
        self.sync = SyncSession(engine.world_size, "adapter" in engine.sync_modes, sync_key)
        self._counter_lock = threading.Lock()
        self.pushes_by_version: dict[int, int] = {}
        self.infer_requests = 0
        self.infer_calls = 0
        self.rejected_requests = 0
        self.busy_refusals = 0
        self.preprocess_in_prepare = True  # False restores the engine-thread preprocessing (benchmarks)

    @property
    def weight_version(self) -> int:
        return self.scheduler.version

    @property
    def broken(self) -> str | None:
        """Why nothing is served (a load failed after the engine may have changed), or ``None``:
        a scheduler state (``server.scheduler``), cleared by the next complete load."""
        return self.scheduler.broken

    def unhealthy(self) -> str | None:
        """Why the server cannot serve (a half-applied load, a stalled engine), or ``None``."""
        if self.broken is not None:
            return self.broken
        if self.scheduler.stopped is not None:
            return f"the rollout engine stopped: {self.scheduler.stopped}"
        stalled = self.watch.stalled()
        return f"the rollout engine is stalled: {stalled}" if stalled else None

    def health(self) -> ServerHealth:
        """``/health/``: lock-free, never waits for the engine."""
        reason = self.unhealthy()
        status = "ok" if reason is None else ("stalled" if self.watch.stalled() else "broken")
        return ServerHealth(
            status=status,
            engine=self.scheduler.state,
            operation=self.watch.current,
            weight_version=self.weight_version,
            detail=reason,
            **self.scheduler.depth(),
        )

    # ------------------------------------------------------------------------------- inference
    async def infer(self, call: InferCall) -> InferAnswer:
        """``POST /infer/``: receive -> validate -> admit -> schedule -> respond (module docstring).
        Raises ``ValueError`` (4xx), ``RequestValidationError`` (422), ``ServerBusy`` (429) or a
        ``BackendError`` (503); the body's bytes are given back to the budget once the call is prepared."""
        times = PhaseTimes()
        lease = self.bodies.lease()
        held = [b""]  # the raw body, dropped once the call is prepared (the engine wait never holds it)
        try:
            with times.phase("receive"):
                held[0] = await call.read_body(lease)
        except BaseException:  # over a cap, a cancelled request: the budget is given back at once
            lease.release()
            raise

        def validate() -> PreparedCall:  # worker-thread hop 1: parse and prepare (images decoded)
            try:
                with times.phase("parse"):
                    raw, held[0] = held[0], b""
                    self.check_body(raw)
                    body = parse_json_body(InferBody, raw, call.content_type)
                    del raw
                with times.phase("prepare"):
                    return self.prepare(body, times, gone.is_set)
            finally:
                held[0] = b""
                lease.release()

        gone = threading.Event()  # the client left while its call was prepared: stop between images
        watcher = asyncio.create_task(_watch_disconnect(call.is_disconnected, gone))
        try:
            with self.scheduler.arrival():  # a batching engine waits for calls being prepared
                prepared = await run_in_threadpool(validate)
                ticket = self.submit(prepared)  # admission
        finally:
            watcher.cancel()
        with times.phase("engine"):
            if ticket is not None:
                await self.scheduler.wait_async(ticket, call.is_disconnected)

        def respond() -> bytes:  # worker-thread hop 2
            with times.phase("outputs"):
                outputs = self.outputs(prepared, ticket)
            with times.phase("respond"):
                return INFER_REPLY.dump_json(outputs)

        payload = await run_in_threadpool(respond)
        version = ticket.versions[0] if ticket is not None else self.weight_version
        return InferAnswer(payload, version, times.seconds)

    def check_body(self, raw: bytes) -> None:
        """The checks of a raw ``/infer/`` body before it is parsed (``--max-json-values``,
        ``--max-requests-per-call``): a refusal is counted like any other."""
        try:
            self.limits.check_json_values(raw)
            self.limits.check_request_count(raw)
        except RequestTooLarge:
            self._count(rejected=1)
            raise

    def prepare(
        self, body: InferBody, times: PhaseTimes | None = None, cancelled: Callable[[], bool] | None = None
    ) -> PreparedCall:
        """Caps, cross-field checks and the prepared prompts (images decoded): a ``ValueError`` (4xx)
        names what is wrong; nothing reaches the engine. ``cancelled`` (the client left?) is asked
        before every image is decoded and every prompt preprocessed."""
        self.scheduler.refuse_if_broken()  # before decoding any image
        pixels: PixelLease | None = None
        try:
            with self._admission(len(body.infer_requests)):
                config, prompts, pixels = self.checks.check(
                    body,
                    times if times is not None else PhaseTimes(),
                    cancelled,
                    preprocess=self.preprocess_in_prepare,
                )
            if not prompts:
                return PreparedCall(config, prompts, None, pixels)
            longest = max(len(p.prompt_token_ids) for p in prompts)
            if longest >= self.engine.max_model_len:
                raise ValueError(
                    f"prompt too long: a prompt of {longest} tokens leaves no room for new tokens within the "
                    f"server's max_model_len of {self.engine.max_model_len}; shorten it or serve with a larger "
                    "--max-model-len"
                )
            decoding = decoding_from_request_config(
                config, self.engine.max_model_len - longest, self.limits.max_tokens
            )
        except ValueError:
            if pixels is not None:
                pixels.release()
            self._count(rejected=1)
            raise
        except ServerBusy:  # the decoded pixels of the calls in flight (429)
            self._count(busy=1)
            raise
        return PreparedCall(config, prompts, decoding, pixels)

    @contextmanager
    def _admission(self, count: int) -> Iterator[None]:
        """Hold ``count`` prompts for a call being prepared, refusing it (429) right after its parse,
        before any image is decoded or prompt tokenised, when the prompts queued on the engine and
        those of other calls being prepared leave no room; :meth:`submit` then admits it."""
        with self._counter_lock:
            queued = self.scheduler.depth()["outstanding_prompts"]
            limit = self.limits.max_queued_prompts
            if count <= limit and queued + self._preparing_prompts + count > limit:
                raise ServerBusy(
                    f"the server holds {queued} prompts queued or running and {self._preparing_prompts} being "
                    f"prepared; this call's {count} would pass its limit of {limit} (rollmatch serve "
                    "--max-queued-prompts); retry later or add servers",
                    retry_after_s=1.0,
                )
            self._preparing_prompts += count
        try:
            yield
        finally:
            with self._counter_lock:
                self._preparing_prompts -= count

    def submit(self, call: PreparedCall) -> CallTicket | None:
        """Queue a prepared call on the engine (``None``: nothing to generate). Its images' pixels are
        given back once the engine is done with the call, whether or not its client still waits."""
        if call.decoding is None:
            call.release()
            return None
        try:
            ticket = self.scheduler.submit(
                call.prompts, call.decoding, call.config.seed, tuple(call.config.stop or ())
            )
        except ValueError:  # the call alone is over what the server queues (413)
            call.release()
            self._count(rejected=1)
            raise
        except BackendError:  # full (429) or stalled (503)
            call.release()
            self._count(busy=1)
            raise
        ticket.on_done(call.release)
        return ticket

    def outputs(self, call: PreparedCall, ticket: CallTicket | None) -> list[RolloutOutput]:
        """The reply items of a done call; raises the call's error (mapped to a 4xx / 503)."""
        if ticket is None:
            return []
        if ticket.error is not None:
            raise ticket.error
        engine_outputs = [o for o in ticket.outputs if o is not None]
        self._count(calls=1, requests=len(engine_outputs))
        if call.config.stop:
            tokenizer = self.engine.preparer.tokenizer
            engine_outputs = [apply_stops(out, call.config.stop, tokenizer) for out in engine_outputs]
        first, last = ticket.versions
        return [
            rollout_output(
                self.engine.model_dir, p, out, (first, last), call.config.return_details, call.config.logprobs
            )
            for p, out in zip(call.prompts, engine_outputs, strict=True)
        ]

    async def reset_prefix_cache(self) -> None:
        """Reset every engine cache once in-flight calls finished (new calls wait behind it); waits on
        the event loop, joins a pending reset, and is a no-op when nothing changed since the last."""
        await self.scheduler.reset_caches()

    def _count(self, *, calls: int = 0, requests: int = 0, rejected: int = 0, busy: int = 0) -> None:
        with self._counter_lock:
            self.infer_calls += calls
            self.infer_requests += requests
            self.rejected_requests += rejected
            self.busy_refusals += busy

    # ---------------------------------------------------------------------------- weight sync
    def init_communicator(
        self, body: InitCommunicatorBody, requester: str = "?", sync_key: str | None = None
    ) -> InitCommunicatorReply:
        """Start forming the weight-sync group (``sync_key``: the caller's, checked when the server has
        one); returns the sync lease the trainer must send and the digest key of its checksums."""
        return self.sync.init(body, requester, sync_key)

    def update_bucket(self, body: UpdateFlattenedParamsBody | UpdateAdapterBody, lease: str | None) -> None:
        self.sync.receive_bucket(body, lease)

    def finish_update(self, body: FinishUpdateBody, lease: str | None) -> FinishUpdateReply:
        """Verify the staged update, load it, then acknowledge; any rejection keeps the old version.
        A broken server accepts a load: a complete one serves again (see ``server.scheduler``)."""
        replies: list[FinishUpdateReply] = []

        def load(update: VerifiedUpdate) -> None:
            # On the engine thread, fair against new calls (in-flight calls per the update mode). A
            # failure after the engine may have changed breaks the scheduler there, atomically.
            label = f"weight version {update.version} ({update.mode})"
            self.scheduler.run_operation(WEIGHT_LOAD, lambda: self._load(update), is_load=True, label=label)
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

    def _load(self, update: VerifiedUpdate) -> int:
        """Engines validate names and shapes before changing anything (a ``SyncError`` is clean, and
        so is an adapter's ``BackendError``); any other failure leaves the engine's weights unknown:
        raised as a ``BackendError`` naming it, which breaks the scheduler. Returns the new version
        (the scheduler then resets the caches)."""
        if update.adapter is not None:
            try:
                self.engine.load_adapter(update.tensors, update.adapter)
            except SyncError:
                raise
            except BackendError as exc:  # refused before the switch: the previous adapter is still served
                raise SyncError(f"adapter of version {update.version} could not be loaded: {exc}") from exc
            except Exception as exc:  # failed after the switch (or unknown where): stop serving
                raise BackendError(
                    f"switching to the adapter of weight version {update.version} failed ({type(exc).__name__}: "
                    f"{exc})"
                ) from exc
        else:
            check_weight_coverage(update.tensors, self.engine.required_weights, self.engine.model_dir)
            try:
                self.engine.load_weights(update.tensors)
            except SyncError:
                raise
            except Exception as exc:  # a half-applied load: the scheduler breaks, then this reports
                raise BackendError(
                    f"loading weight version {update.version} failed half-way ({type(exc).__name__}: {exc})"
                ) from exc
        return update.version

    def close_communicator(self, lease: str | None = None) -> bool:
        """Drop the group (the lease holder only); False when there was none to drop."""
        return self.sync.close(lease)

    def check_lease(self, lease: str | None) -> None:
        """Refuse (409) a weight-sync call without the current sync lease, before its body is read."""
        self.sync.check_lease(lease)

    def check_sync_key(self, sync_key: str | None) -> None:
        """Refuse (403) a group formation without the server's sync key, when it has one."""
        self.sync.check_sync_key(sync_key)

    # ----------------------------------------------------------------------------------- facts
    def world_size(self) -> int:
        """The engine's ranks: the weight-sync group holds them and the trainer."""
        return self.engine.world_size

    def engine_type(self) -> dict[str, object]:
        """``/get_engine_type/`` in ms-swift's shape."""
        return {
            "engine_type": "LLMEngine",
            "enable_multi_turn": False,
            "use_gym_env": False,
            "enable_lora": "adapter" in self.engine.sync_modes,
        }

    def info(self) -> ServerInfo:
        engine = self.engine
        size = engine.preparer.processor.image_processor.size
        return ServerInfo(
            engine=engine.name,
            model_dir=engine.model_dir,
            fingerprint=engine.fingerprint,
            dtype=engine.dtype,
            max_model_len=engine.max_model_len,
            world_size=engine.world_size,
            weight_version=self.weight_version,
            sync_modes=list(engine.sync_modes),
            object_formats=supported_object_formats(engine.preparer.tokenizer),
            coord_frame=self.coord_frame,
            min_pixels=int(size["shortest_edge"]),
            max_pixels=int(size["longest_edge"]),
            image_probe=self._probe,
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
            busy_refusals=self.busy_refusals,
            rerun_calls=self.scheduler.rerun_calls,
            update_mode=self.scheduler.update_mode,
            communicator=self.sync.describe(),
        )

    def close(self) -> None:
        self.scheduler.close()
        self.sync.shutdown()
        self.engine.close()


async def _watch_disconnect(is_disconnected: Callable[[], Awaitable[bool]], gone: threading.Event) -> None:
    """Set ``gone`` once the client disconnects (polled every quarter second until cancelled)."""
    while not await is_disconnected():
        await asyncio.sleep(_DISCONNECT_POLL_S)
    gone.set()
