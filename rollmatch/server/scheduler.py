"""The rollout server's engine thread: continuous batching across calls, fair weight updates.

Owns: :class:`EngineScheduler` (one thread owns the engine), :class:`CallTicket` (one ``/infer/``
call in flight), :class:`ServingState` and the update modes. Leaves out: request checks and
preparation (``server.rollout_server``), what an engine is (``server.engines``) and HTTP.

How calls share the engine: a call is *submitted* (admission: bounded prompts and prompt tokens
outstanding, else :class:`~rollmatch.errors.ServerBusy`, a 429), then *admitted* by the engine
thread, which adds every prompt as its own engine request with its own decoding and seed
(``seed + j`` for prompt ``j``); the images were already through the engine's processor (the
prepare hop, ``ServerEngine.preprocess``), and while calls decode at most ``ADMIT_PROMPTS_PER_STEP``
new prompts are added between two steps, as a watched ``admission`` operation. A call whose
client left is cancelled (:meth:`EngineScheduler.cancel`). The vLLM engine schedules all
admitted requests together (continuous batching: a call arriving mid-generation joins at the next
engine step); the HF engine runs up to ``max_step_prompts`` admitted prompts as one batch per step,
calls arriving while a batch runs join the next one, and from idle it waits (at most
``join_window_s``) for calls still being prepared. A call's outputs do not depend on what else
runs, because seeds are per request.

Exclusive operations (weight loads, cache resets) are queued like calls but go first: once one is
pending, no new call is admitted (fair against new calls; an update cannot starve). A weight load
then follows the update mode:

- ``drain`` (default): in-flight calls finish under the old weights, at most ``drain_timeout_s``;
  calls still running then are aborted and re-run whole under the new weights;
- ``abort``: in-flight calls are aborted at once and re-run whole under the new weights;
- ``keep``: in-flight sequences continue under the new weights with their KV cache kept; their
  outputs report the first and the last version that produced them (``CallTicket.versions``); new
  calls are admitted once those finish and the caches are reset, so they see only new weights.

Every other call reports one version: all its outputs come from the weights it was admitted
under (a re-run call is admitted again). A call is re-run at most ``max_reruns`` times: an update
that finds such a call running waits for it (as ``drain`` would, without its timeout), so a call
longer than the push interval still finishes (no re-run livelock).

A load that fails after the engine may have changed (anything but a ``SyncError`` refusal, or the
cache reset after a load) leaves the weights unknown: the scheduler is then *broken*. Every pending
and running call fails at once with a 503 naming the cause, new calls are refused, and only a load
that completes (weights taken, caches reset) serves again.

Cache resets coalesce: a reset requested while another is pending joins it, and one requested with
nothing generated or loaded since the last reset returns at once. Every reset drains (engines
refuse it mid-run).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal

from rollmatch.errors import BackendError, ServerBusy, SyncError
from rollmatch.rollout.types import Decoding
from rollmatch.server.engine_watch import ADMISSION, CACHE_RESET, GENERATION, EngineWatch
from rollmatch.server.limits import RequestTooLarge, ServerLimits, UpdateMode
from rollmatch.server.tickets import CallTicket, EngineOperation

if TYPE_CHECKING:
    from rollmatch.server.engines import EngineOutput, ServerEngine
    from rollmatch.server.prompt_preparer import PreparedPrompt

log = logging.getLogger(__name__)
ServingState = Literal["idle", "generating", "updating", "stalled", "broken", "stopped"]
_POLL_S = 0.25
ADMIT_PROMPTS_PER_STEP = 8


class EngineScheduler:
    """The one thread that drives the engine (see the module docstring); every method is thread-safe."""

    def __init__(
        self,
        engine: ServerEngine,
        watch: EngineWatch,
        limits: ServerLimits,
        *,
        on_failure: Callable[[BaseException], BaseException] = lambda exc: exc,
    ):
        """``limits``: the server's caps (validated there); the scheduler reads the update mode, the
        drain timeout, the re-run bound and the admission queues' sizes from it."""
        self.engine, self.watch = engine, watch
        self.update_mode: UpdateMode = limits.update_mode
        self.drain_timeout_s = float(limits.drain_timeout_s)
        self.max_queued_prompts = limits.max_queued_prompts
        self.max_queued_prompt_tokens = limits.max_queued_prompt_tokens
        self.max_reruns = int(limits.max_reruns)
        # Prompts admitted between two steps while others decode (whole calls, at least one): running
        # sequences never wait for a whole burst of arrivals. ``None`` admits everything pending.
        self.admit_prompts_per_step: int | None = ADMIT_PROMPTS_PER_STEP
        self._on_failure = on_failure
        self.version = 0
        self._cond = threading.Condition()
        self._pending: deque[CallTicket] = deque()
        self._operations: deque[EngineOperation] = deque()
        self._running: dict[str, tuple[CallTicket, int]] = {}  # engine request id -> (call, prompt index)
        self._running_calls: dict[int, CallTicket] = {}
        self._outstanding_prompts = 0
        self._outstanding_tokens = 0
        self._caches_stale = False  # ``keep`` mode: reset once the kept sequences finish
        self._kept_load_label = "the weight load"  # the load whose cache reset is pending (``keep``)
        self._caches_dirty = False  # generated or loaded since the last cache reset
        self._broken: str | None = None  # weights unknown after a failed load: nothing is served
        self._cancelled: list[tuple[CallTicket, str]] = []  # running calls to abort on the engine thread
        self._ids = itertools.count()
        self._arriving = 0  # calls being prepared (see :meth:`arrival`)
        self._stopping = False
        self._closed_reason: str | None = None
        self.rerun_calls = 0
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------------- calls
    def submit(
        self, prompts: list[PreparedPrompt], decoding: Decoding, seed: int | None, stop: tuple[str, ...] = ()
    ) -> CallTicket:
        """Queue a call; :class:`ServerBusy` when the server holds too much already."""
        tokens = sum(len(p.prompt_token_ids) for p in prompts)
        if len(prompts) > self.max_queued_prompts or tokens > self.max_queued_prompt_tokens:
            raise RequestTooLarge(
                "infer_requests",
                f"this call alone holds {len(prompts)} prompts / {tokens} prompt tokens, over what the server "
                f"queues ({self.max_queued_prompts} / {self.max_queued_prompt_tokens}: --max-queued-prompts, "
                "--max-queued-prompt-tokens); split the call",
            )
        with self._cond:
            self._refuse_if_unusable()
            if (
                self._outstanding_prompts + len(prompts) > self.max_queued_prompts
                or self._outstanding_tokens + tokens > self.max_queued_prompt_tokens
            ):
                raise ServerBusy(
                    f"the server holds {self._outstanding_prompts} prompts / {self._outstanding_tokens} prompt "
                    f"tokens already (limits --max-queued-prompts {self.max_queued_prompts}, "
                    f"--max-queued-prompt-tokens {self.max_queued_prompt_tokens}); retry later or add servers",
                    retry_after_s=1.0,
                )
            ticket = CallTicket(next(self._ids), list(prompts), decoding, seed, tokens, tuple(stop))
            ticket.outputs = [None] * len(prompts)
            self._outstanding_prompts += len(prompts)
            self._outstanding_tokens += tokens
            self._pending.append(ticket)
            self._cond.notify_all()
        return ticket

    @contextmanager
    def arrival(self) -> Iterator[None]:
        """Wrap a call's preparation and :meth:`submit`: an engine that batches whole calls (``hf``)
        starting from idle waits for calls being prepared, so calls sent together run together."""
        with self._cond:
            self._arriving += 1
        try:
            yield
        finally:
            with self._cond:
                self._arriving -= 1
                self._cond.notify_all()

    def cancel(self, ticket: CallTicket, why: str) -> None:
        """Give up a call (its client left): a queued call is dropped at once, a running one is aborted
        by the engine thread before its next step; either way it fails naming ``why`` and its prompts
        and pixels are released. A call already done is left as it is."""
        error = BackendError(f"call cancelled: {why}; nothing of it is answered")
        with self._cond:
            if ticket.done.is_set():
                return
            queued = any(t is ticket for t in self._pending)
            if queued:
                self._pending = deque(t for t in self._pending if t is not ticket)
            else:
                self._cancelled.append((ticket, why))
                self._cond.notify_all()
        if queued:
            self._done(ticket, error)
        else:  # a running HF generate stops the call's rows at its next decoding step
            self._interrupt([ticket])

    async def wait_async(
        self, ticket: CallTicket, gone: Callable[[], Awaitable[bool]] | None = None
    ) -> list[EngineOutput]:
        """Wait for ``ticket`` on the event loop (no thread held); fails once the engine is stalled
        (never waits forever) and raises the call's error. ``gone`` (the
        client disconnected?) is polled every quarter second; once true the call is cancelled
        (:meth:`cancel`) and this raises its error."""
        try:
            await self._await_done(ticket, gone, lambda: self.cancel(ticket, "the client disconnected"))
        except BackendError as exc:  # the engine stalled: this call is answered 503 now, so it must not
            # stay queued (holding its prompts in --max-queued-prompts) nor run once the engine recovers
            self.cancel(ticket, f"its waiter gave up ({exc})")
            raise
        if not ticket.done.is_set():  # cancelled: the engine thread aborts it at its next step
            raise BackendError("call cancelled: the client disconnected; nothing of it is answered")
        return self._result(ticket)

    async def _await_done(
        self,
        holder: CallTicket | EngineOperation,
        gone: Callable[[], Awaitable[bool]] | None = None,
        on_gone: Callable[[], None] | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))
            except RuntimeError:  # the waiter's loop is closed (its client left): nobody to wake
                return

        holder.on_done(wake)
        try:
            while True:
                try:
                    await asyncio.wait_for(asyncio.shield(done), _POLL_S)
                    return
                except TimeoutError:
                    self._fail_if_stalled()
                    if gone is not None and on_gone is not None and await gone():
                        on_gone()
                        return
        finally:
            holder.forget(wake)

    # ------------------------------------------------------------------------------ operations
    def run_operation(
        self, what: str, fn: Callable[[], int | None], *, is_load: bool, label: str = ""
    ) -> None:
        """Run ``fn`` on the engine thread with no generation running (see the update modes);
        a load's ``fn`` returns the new weight version and raises ``SyncError`` only when it refused
        before changing anything (any other error breaks the scheduler, see the module docstring).
        Blocks until done; raises what ``fn`` raised. Allowed while broken (a complete load heals)."""
        operation = EngineOperation(what, fn, is_load, label or what)
        with self._cond:
            self._refuse_if_stopped()
            self._operations.append(operation)
            self._cond.notify_all()
        self._interrupt_if_aborting(operation)
        while not operation.done.wait(_POLL_S):
            self._fail_if_stalled()
            self._interrupt_if_aborting(operation)  # the drain timeout passed while a step runs
        if operation.error is not None:
            raise operation.error

    def _interrupt(self, calls: list[CallTicket]) -> None:
        """Ask the engine to end these calls' requests at the running step's next decoding step (the
        engine thread aborts them after it): an HF step generates whole responses otherwise."""
        self.engine.interrupt([t.request_id(i) for t in calls for i in range(len(t.prompts))])

    def _interrupt_if_aborting(self, operation: EngineOperation) -> None:
        """From a waiting thread: when ``operation`` would abort the running calls now (abort mode, the
        drain timeout), interrupt them so the engine thread gets to it within a decoding step."""
        try:
            calls = list(self._running_calls.values())
            if calls and self._with_calls_in_flight(operation)[1] is not None:
                self._interrupt(calls)
        except RuntimeError:  # the engine thread changed the running calls meanwhile: next poll
            return

    async def reset_caches(self) -> None:
        """Reset the engine's caches once in-flight calls finished, waiting on the event loop (no
        thread held). Joins a reset already pending; returns at once when nothing was generated or
        loaded since the last reset."""
        if not self.engine.has_prefix_cache:
            return  # nothing to forget (HF generate): never a drain
        with self._cond:
            self._refuse_if_stopped()
            operation = next((op for op in self._operations if op.what == CACHE_RESET), None)
            if operation is None:
                if not self._caches_dirty and not self._operations and not self._running:
                    return
                operation = EngineOperation(CACHE_RESET, self._reset_now, is_load=False, label=CACHE_RESET)
                self._operations.append(operation)
                self._cond.notify_all()
        await self._await_done(operation)
        if operation.error is not None:
            raise operation.error

    def _reset_now(self) -> None:
        self.engine.reset_caches()
        self._caches_dirty = False

    # ----------------------------------------------------------------------------------- state
    @property
    def state(self) -> ServingState:
        if self._closed_reason is not None:
            return "stopped"
        if self.watch.stalled() is not None:
            return "stalled"
        if self._broken is not None:
            return "broken"
        if self._operations or self.watch.current not in (None, GENERATION):
            return "updating"
        return "generating" if self._running_calls else "idle"

    @property
    def stopped(self) -> str | None:
        """Why the engine thread stopped serving (shut down, or failed unexpectedly), or ``None``."""
        return self._closed_reason

    @property
    def broken(self) -> str | None:
        """Why nothing is served (a load failed after the engine may have changed), or ``None``."""
        return self._broken

    def depth(self) -> dict[str, int]:
        """Queue depth, lock-free (a snapshot for health and stats)."""
        return {
            "queued_calls": len(self._pending),
            "running_calls": len(self._running_calls),
            "outstanding_prompts": self._outstanding_prompts,
            "pending_operations": len(self._operations),
        }

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread; every call not yet done fails with a 503."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=timeout_s)
        self._fail_everything(BackendError("the rollout server is shutting down; nothing was generated"))

    # ----------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (
                    self._stopping or self._pending or self._operations or self._running or self._cancelled
                ):
                    self._cond.wait(1.0)
                if self._stopping:
                    return
                operation = self._operations[0] if self._operations else None
                cancelled, self._cancelled = self._cancelled, []
            try:
                self._drop_cancelled(cancelled)
                if operation is not None:
                    self._serve_operation(operation)
                elif self._caches_stale and not self._running:
                    self._reset_kept_caches()
                else:
                    if not self._caches_stale:
                        self._admit_pending()
                    if self._running:
                        self._step()
            except BaseException as exc:  # the engine thread must never die silently
                log.exception("rollout engine thread: unexpected failure")
                self._fail_everything(BackendError(f"the rollout engine thread failed: {exc}"))

    def _serve_operation(self, operation: EngineOperation) -> None:
        if self._running:
            may_run, abort_why = self._with_calls_in_flight(operation)
            if not may_run:
                self._step()  # drain: in-flight calls finish under the current weights
                return
            if abort_why is not None:
                self._abort_running(abort_why)
        keep = operation.is_load and bool(self._running)
        loaded = False
        error: BaseException | None = None
        try:
            with self.watch.operation(operation.what):
                version = operation.fn()
            if version is not None:
                self.version = version
            if operation.is_load:
                loaded = True
                self._caches_stale = self._caches_dirty = True
                self._kept_load_label = operation.label
                if not keep:
                    self._reset_caches()
                self._broken = None  # a complete load: the weights are known again
        except BaseException as exc:
            error = exc
            if operation.is_load and (loaded or not isinstance(exc, SyncError)):
                self._break(_broken_reason(operation.label, exc, loaded))
                error = (
                    BackendError(f"this rollout server stopped serving: {self._broken}") if loaded else exc
                )
        with self._cond:
            self._operations.popleft()
        operation._finish(error)

    def _break(self, reason: str) -> None:
        """The weights are unknown: fail every pending and running call, refuse new ones (503)."""
        with self._cond:
            self._broken = reason
            calls = list(self._pending) + list(self._running_calls.values())
            self._pending.clear()
        if self._running:
            self.engine.abort(list(self._running))
        self._running.clear()
        self._running_calls.clear()
        error = BackendError(_broken_message(reason))
        for ticket in calls:
            self._done(ticket, error)
        log.error(
            "rollout server broken: %s; %d call(s) failed, nothing is served until a complete load",
            reason,
            len(calls),
        )

    def _drop_cancelled(self, cancelled: list[tuple[CallTicket, str]]) -> None:
        for ticket, why in cancelled:
            if ticket.done.is_set():
                continue
            ids = [i for i, (t, _) in self._running.items() if t is ticket]
            if ids:
                self.engine.abort(ids)
                for request_id in ids:
                    self._running.pop(request_id, None)
            self._running_calls.pop(ticket.call_id, None)
            with self._cond:
                self._pending = deque(t for t in self._pending if t is not ticket)
            self._done(ticket, BackendError(f"call cancelled: {why}; nothing of it is answered"))

    def _with_calls_in_flight(self, operation: EngineOperation) -> tuple[bool, str | None]:
        """May ``operation`` run now, with calls in flight, and if only by aborting them, why? (A query:
        the caller aborts.) ``(False, None)``: it waits while they drain."""
        if operation.is_load and self.update_mode == "keep":
            return True, None
        if any(t.attempts >= self.max_reruns for t in list(self._running_calls.values())):
            return False, None  # a call re-run max_reruns times already: this operation waits for it
        if operation.is_load and self.update_mode == "abort":
            return True, "the abort update mode"
        if time.monotonic() - operation.queued_at < self.drain_timeout_s:  # counted from the request
            return False, None
        return True, f"the drain timeout ({self.drain_timeout_s:g}s, --drain-timeout-s)"

    def _abort_running(self, why: str) -> None:
        calls = list(self._running_calls.values())
        self.engine.abort(list(self._running))
        self._running.clear()
        self._running_calls.clear()
        for ticket in calls:
            ticket.outputs = [None] * len(ticket.prompts)
            ticket.attempts += 1
        self.rerun_calls += len(calls)
        with self._cond:
            self._pending.extendleft(reversed(calls))  # first in line once generation resumes
        log.info("%d call(s) aborted by %s; they run again under the new weights", len(calls), why)

    def _reset_caches(self) -> None:
        with self.watch.operation(CACHE_RESET):
            self.engine.reset_caches()
        self._caches_stale = self._caches_dirty = False

    def _reset_kept_caches(self) -> None:
        """The reset a ``keep``-mode load left for when its kept calls finished. A failure is the one a
        reset right after the load would have been: the server is broken until the next complete load
        (which resets again), not stopped for good."""
        try:
            self._reset_caches()
        except Exception as exc:  # the engine's own error, whatever its type: named in the reason
            self._caches_stale = False  # not retried in a loop: the next load resets the caches
            self._break(_broken_reason(self._kept_load_label, exc, loaded=True))

    def _admit_pending(self) -> None:
        window = self.engine.join_window_s
        with self._cond:
            if window > 0 and not self._running:  # from idle: calls sent together start as one batch
                deadline = time.monotonic() + window
                while self._arriving > 0 and (left := deadline - time.monotonic()) > 0:
                    self._cond.wait(left)
            admitted: list[CallTicket] = []
            budget = self.admit_prompts_per_step if self._running else None
            while self._pending and (
                budget is None or not admitted or budget >= len(self._pending[0].prompts)
            ):
                ticket = self._pending.popleft()
                admitted.append(ticket)
                if budget is not None:
                    budget -= len(ticket.prompts)
        if not admitted:
            return
        with self.watch.operation(ADMISSION):  # watched: a hang while adding shows as a stall
            for ticket in admitted:
                self._admit(ticket)

    def _admit(self, ticket: CallTicket) -> None:
        ticket.first_version = self.version
        added: list[str] = []
        try:
            for index, prompt in enumerate(ticket.prompts):
                request_id = ticket.request_id(index)
                seed = None if ticket.seed is None else ticket.seed + index
                self.engine.add(request_id, prompt, ticket.decoding, seed, ticket.stop)
                self.watch.progress()
                added.append(request_id)
                self._running[request_id] = (ticket, index)
        except Exception as exc:  # this call's values: only this call fails
            for request_id in added:
                self._running.pop(request_id, None)
            self.engine.abort(added)
            self._done(ticket, self._on_failure(exc))
            return
        self._running_calls[ticket.call_id] = ticket

    def _step(self) -> None:
        self._caches_dirty = True
        try:
            with self.watch.operation(GENERATION):
                finished = self.engine.step()
        except Exception as exc:  # the engine failed mid-step: every running call fails, the engine recovers
            calls = list(self._running_calls.values())
            self._running.clear()
            self._running_calls.clear()
            self.engine.recover()
            error = self._on_failure(exc)
            for ticket in calls:
                self._done(ticket, error)
            return
        for request_id, output in finished:
            entry = self._running.pop(request_id, None)
            if entry is None:
                continue  # a request aborted in the same step
            ticket, index = entry
            ticket.outputs[index] = output
            if all(o is not None for o in ticket.outputs):
                ticket.last_version = self.version
                self._running_calls.pop(ticket.call_id, None)
                self._done(ticket, None)

    def _done(self, ticket: CallTicket, error: BaseException | None) -> None:
        with self._cond:
            self._outstanding_prompts -= len(ticket.prompts)
            self._outstanding_tokens -= ticket.prompt_tokens
        ticket._finish(error)

    def _fail_everything(self, error: BaseException) -> None:
        with self._cond:
            calls = list(self._pending) + list(self._running_calls.values())
            operations = list(self._operations)
            self._pending.clear()
            self._operations.clear()
            self._running.clear()
            self._running_calls.clear()
            self._closed_reason = self._closed_reason or str(error)
        for ticket in calls:
            if not ticket.done.is_set():
                self._done(ticket, error)
        for operation in operations:
            operation._finish(error)

    # ---------------------------------------------------------------------------------- checks
    def _result(self, ticket: CallTicket) -> list[EngineOutput]:
        if ticket.error is not None:
            raise ticket.error
        return [o for o in ticket.outputs if o is not None]

    def refuse_if_broken(self) -> None:
        """Raise the 503 of a broken (or stopped, or stalled) scheduler; nothing when it serves."""
        self._refuse_if_unusable()

    def _refuse_if_unusable(self) -> None:
        self._refuse_if_stopped()
        if self._broken is not None:
            raise BackendError(_broken_message(self._broken))

    def _refuse_if_stopped(self) -> None:
        if self._closed_reason is not None:
            raise BackendError(f"the rollout engine stopped: {self._closed_reason}")
        self._fail_if_stalled()

    def _fail_if_stalled(self) -> None:
        stalled = self.watch.stalled()
        if stalled is not None:
            raise BackendError(f"the rollout engine is stalled ({stalled}); restart the server")


def _broken_reason(label: str, exc: BaseException, loaded: bool) -> str:
    if loaded:
        return f"{label} was loaded, then resetting the engine's caches failed ({type(exc).__name__}: {exc})"
    if isinstance(exc, BackendError):
        return str(exc)  # the loader named what failed
    return f"{label} failed after the engine may have changed ({type(exc).__name__}: {exc})"


def _broken_message(reason: str) -> str:
    return (
        f"this rollout server stopped serving: {reason}; its weights are unknown, so nothing is generated "
        "until a complete weight update is loaded (push one, or restart the server)"
    )
