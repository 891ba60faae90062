"""The rollout server's behaviour, HTTP-free: inference, weight loads, health, counters.

Owns: :class:`RolloutServer`: request checks against the server's caps
(:class:`~rollmatch.server.limits.ServerLimits`), stop strings, the weight version, health, and the
glue between calls and weight syncs and the :class:`~rollmatch.server.scheduler.EngineScheduler`
that runs them on the engine (continuous batching across calls, fair weight updates, a watchdog on
every engine operation). A failed generation leaves the engine clean for the next request.
Leaves out: HTTP (``server.app``), request preparation (``server.prompt_preparer``), the engine thread
(``server.scheduler``) and the weight-sync group (``server.sync_session``).

A call goes through three steps, so the HTTP layer can wait for the engine without holding a
thread: :meth:`RolloutServer.prepare` (caps, ids, images: a worker thread), :meth:`RolloutServer.submit`
(admission: 429 when the server holds too much), then :meth:`RolloutServer.outputs` once the ticket
is done (``EngineScheduler.wait_async``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rollmatch.data.prompts import PROBE_IMAGE_SIZE, image_probe
from rollmatch.detection.coord_tokens import supported_object_formats
from rollmatch.errors import BackendError, ServerBusy, SyncError
from rollmatch.protocol import (
    SEED_MAX,
    ChatChoice,
    ChatCompletionResponse,
    ChatMessage,
    FinishUpdateBody,
    FinishUpdateReply,
    ImageProbe,
    InferBody,
    InferRequest,
    InitCommunicatorBody,
    InitCommunicatorReply,
    RequestConfig,
    RolloutOutput,
    ServerHealth,
    ServerInfo,
    ServerStats,
    UpdateAdapterBody,
    UpdateFlattenedParamsBody,
    Usage,
    decoding_from_request_config,
    logprob_content,
)
from rollmatch.rollout.types import Decoding
from rollmatch.server.bodies import BodyBudget
from rollmatch.server.engine_watch import WEIGHT_LOAD, EngineWatch
from rollmatch.server.engines import EngineOutput, ServerEngine, check_weight_coverage
from rollmatch.server.limits import RequestTooLarge, ServerLimits
from rollmatch.server.media import PixelBudget, PixelLease, TensorBudget
from rollmatch.server.prompt_preparer import PreparedPrompt, chat_messages, trim_at_stop_strings
from rollmatch.server.scheduler import CallTicket, EngineScheduler
from rollmatch.server.sync_session import SyncSession
from rollmatch.server.timing import PhaseTimes
from rollmatch.sync.transaction import VerifiedUpdate

log = logging.getLogger(__name__)


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
    """The server's state; every public method is one endpoint's behaviour (HTTP-free, testable)."""

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
        self.scheduler = EngineScheduler(engine, self.watch, self.limits, on_failure=_engine_failure)
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
                config, prompts, pixels = self._checked(
                    body, times if times is not None else PhaseTimes(), cancelled
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
            engine_outputs = [self._apply_stops(out, call.config.stop) for out in engine_outputs]
        first, last = ticket.versions
        return [
            _rollout_output(
                self.engine.model_dir, p, out, (first, last), call.config.return_details, call.config.logprobs
            )
            for p, out in zip(call.prompts, engine_outputs, strict=True)
        ]

    def _checked(
        self, body: InferBody, times: PhaseTimes, cancelled: Callable[[], bool] | None = None
    ) -> tuple[RequestConfig, list[PreparedPrompt], PixelLease]:
        """Caps and cross-field checks the wire models cannot know; then the call's images checked from
        their headers and their pixels reserved before any is decoded (``server.media``); then the
        prepared prompts."""
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
        self._check_prompt_ids_fit(body.infer_requests)
        preparer = self.engine.preparer
        images = list(_image_sources(body.infer_requests, preparer.max_images))
        encoded: dict[str, bytes] = {}  # base64 decoded once: for the header check, then for decoding
        sizes: list[tuple[int, int]] = []
        pixels = self.pixels.reserve_call(images, preparer.media, encoded, sizes)
        try:
            # What the processor makes of them, before any is decoded (released with the pixels).
            pixels.linked.append(self.tensors.reserve(sum(preparer.tensor_bytes(w, h) for w, h in sizes)))
            self._check_chat_lengths(
                body.infer_requests, dict(zip((n for n, _ in images), sizes, strict=False))
            )
            prompts = [
                preparer.prepare(r, i, times, encoded, cancelled) for i, r in enumerate(body.infer_requests)
            ]
            pixels.cover(sum(image.width * image.height for p in prompts for image in p.images))
            if self.preprocess_in_prepare:
                with times.phase("preprocess"):
                    self._preprocess(prompts)
        except BaseException:
            pixels.release()
            raise
        return config, prompts, pixels

    def _preprocess(self, prompts: list[PreparedPrompt]) -> None:
        """The engine's image processing, here in the prepare hop so the engine thread only decodes;
        what the engine refuses is the request's fault (400), anything else the engine's (503)."""
        for prompt in prompts:
            try:
                self.engine.preprocess(prompt)
            except BackendError:
                raise
            except Exception as exc:
                raise _engine_failure(exc) from exc

    def _check_chat_lengths(self, requests: list[InferRequest], sizes: dict[str, tuple[int, int]]) -> None:
        """Refuse a call whose chat prompt leaves no room within ``max_model_len``, each prompt
        tokenised in turn (its images counted from their header sizes) before any image is decoded."""
        for index, request in enumerate(requests):
            if request.prompt_token_ids:
                continue
            length = self.engine.preparer.chat_length(request, index, sizes)
            if length >= self.engine.max_model_len:
                raise ValueError(
                    f"prompt too long: infer_requests[{index}].messages make a prompt of {length} tokens, which "
                    f"leaves no room for new tokens within the server's max_model_len of "
                    f"{self.engine.max_model_len}; shorten it or serve with a larger --max-model-len"
                )

    def _check_prompt_ids_fit(self, requests: list[InferRequest]) -> None:
        """Refuse a call whose given prompt ids leave no room within ``max_model_len`` before any of
        its images is decoded."""
        longest = max((len(r.prompt_token_ids or ()) for r in requests), default=0)
        if longest >= self.engine.max_model_len:
            index = next(i for i, r in enumerate(requests) if len(r.prompt_token_ids or ()) == longest)
            raise ValueError(
                f"prompt too long: a prompt of {longest} tokens leaves no room for new tokens within the server's "
                f"max_model_len of {self.engine.max_model_len} (infer_requests[{index}].prompt_token_ids); "
                "shorten it or serve with a larger --max-model-len"
            )

    def _apply_stops(self, out: EngineOutput, stops: list[str]) -> EngineOutput:
        trimmed = trim_at_stop_strings(out.token_ids, out.text, stops, self.engine.preparer.tokenizer)
        if trimmed is None:
            return out
        kept = len(trimmed[0])  # the log-probs of the kept tokens; the stop string is no stop token
        logprobs = None if out.logprobs is None else out.logprobs[:kept]
        return EngineOutput(out.prompt_token_ids, trimmed[0], trimmed[1], "stop", logprobs)

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

    # ----------------------------------------------------------------------------------- facts
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


def _image_sources(requests: list[InferRequest], max_images: int) -> Iterator[tuple[str, str]]:
    """``(field name, value)`` of every image the call's prompts use, as ``PromptPreparer.prepare``
    takes them; a prompt over ``max_images`` is left out (prepare refuses it before decoding)."""
    for index, request in enumerate(requests):
        where = f"infer_requests[{index}]"
        if request.prompt_token_ids:
            sources = [(f"{where}.images[{i}]", value) for i, value in enumerate(request.images)]
        else:
            sources = chat_messages(request.messages, request.images, where)[1]
        if len(sources) <= max_images:
            yield from sources


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
    model: str,
    prompt: PreparedPrompt,
    out: EngineOutput,
    versions: tuple[int, int],
    details: bool,
    logprobs: bool = False,
) -> RolloutOutput:
    """One reply item; ``weight_version`` is the oldest version that produced it (what freshness
    gates use), ``weight_version_last`` the newest (they differ only in the ``keep`` update mode).
    With ``logprobs`` the sampled tokens' log-probs (the stop token's last, when it stopped on one) go in
    ``choice.logprobs`` (swift / OpenAI form) and ``rollout_logprobs``."""
    first, last = versions
    sampled, values = _sampled_logprobs(out) if logprobs else (None, None)
    return RolloutOutput(
        response=ChatCompletionResponse(
            model=model,
            choices=[
                ChatChoice(
                    index=0,
                    message=ChatMessage(content=out.text),
                    finish_reason=out.finish_reason,
                    logprobs=None if sampled is None else logprob_content(sampled, values),
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
        rollout_logprobs=[] if values is None else [values],
        rollout_infos={"weight_version": first, "weight_version_last": last},
        weight_version=first,
        weight_version_last=last,
        sample_id=prompt.sample_id,
    )


def _sampled_logprobs(out: EngineOutput) -> tuple[list[int], list[float]]:
    """The sampled token ids and their log-probs: the response's, then the stop token's (not in the
    stop-trimmed ``token_ids``)."""
    if out.logprobs is None or len(out.logprobs) != len(out.token_ids):
        raise BackendError(
            f"the {type(out).__name__} of this engine carries no log-probs for its {len(out.token_ids)} tokens; "
            "request_config.logprobs needs an engine that records them"
        )
    if out.stop_logprob is None or out.stop_token_id is None:
        return list(out.token_ids), list(out.logprobs)
    return [*out.token_ids, out.stop_token_id], [*out.logprobs, out.stop_logprob]
