"""Channel-B ``async`` mode: the learner side of the async actor-learner.

Owns :class:`AsyncPacks`, which is both the Channel-B strategy and the weight-sync policy of an async
run (they share one notion of the weight version):

- **versions**: step ``s`` trains weights ``v(s) = s // sync_every_steps`` (a resumed run continues the
  numbering). First in every step (before the kind vote), the servers are pushed ``v(s)`` whenever they
  hold another version (and once at the start of every run, before the actors start, so no rollout
  comes from weights the learner no longer has). ``ver`` is then the version of the last completed
  push, as rank 0 broadcast it with the push's outcome: the version the servers hold now.
- **reserve_for_step**: stale packs (``ver_pack < ver - version_window``) are dropped and counted; a step that
  wants B waits up to ``max_wait_s`` for one eligible pack per micro-step and *reserves* what it has
  (the actor can no longer evict them), then reports how many. The planner runs B only if every rank
  holds one per micro-step; otherwise the reserved packs go back to the queue at the next step. While
  it waits, the actor completes the partial pack that used the last of its admission room.
  ``version_window: 0`` is on-policy: B trains only on rollouts of the weights it is about to update.
- **take**: a B step pops its reserved packs, exactly one per micro-step (one packed row each: DDP
  lock-step); it cannot fail, since the vote counted reserved packs only.

Every step it also reports the queue (depth per rank, cumulative produced / trained / dropped counts) and
the actor's rollout metrics. Leaves out: the actor thread (``training.channel_b.actor``), the queue and packs
(``training.channel_b.ready_packs``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from typing import Any

import torch

from rollmatch.rollout.types import RolloutBackend, SyncReport
from rollmatch.training.channel_b.actor import RolloutActor
from rollmatch.training.channel_b.ready_packs import ReadyPackQueue, SegmentOrigin
from rollmatch.training.channel_b.record_stream import StreamLedger
from rollmatch.training.preemption import warning_received
from rollmatch.training.rows import RowPlanner
from rollmatch.training.schedule import StepKind
from rollmatch.training.step import ChannelBatch, ChannelStatus, GaugeKind, Windows

log = logging.getLogger(__name__)
_PREFIX = "stage2_ab/async"
_WAIT_SLICE_S = 0.5


class AsyncPacks:
    """Ready packs of this rank's actor, consumed at optimizer-step boundaries (see the module docstring)."""

    needs_kind = False  # pushes follow the step, not its kind: they run before the kind vote
    always_ready = False  # eligible packs come from the actor: every step votes

    def __init__(
        self,
        *,
        backend: RolloutBackend,
        model: torch.nn.Module,
        actor: RolloutActor,
        queue: ReadyPackQueue[Any],
        rows: RowPlanner,
        version_window: int,
        sync_every_steps: int,
        accounting_path: str | None,
        max_wait_s: float = 0.0,
        trace_path: str | None = None,
        actor_stop_timeout_s: float = 10.0,
    ):
        self.backend = backend
        self.model = model
        self.actor = actor
        self.queue = queue
        self.rows = rows
        self.version_window = version_window
        self.sync_every_steps = sync_every_steps
        self.accounting_path = accounting_path
        self.max_wait_s = max_wait_s
        self.actor_stop_timeout_s = actor_stop_timeout_s  # async.actor_stop_timeout_s
        self.trace_path = (
            trace_path  # async.record_trace: a JSON line per step that trains or drops, and at exit
        )
        self._last_report = (time.perf_counter(), 0)  # (time, actor rollouts) at the previous step
        self._last_step = 0  # the latest step whose metrics were taken (the trace's step at shutdown)
        self._weights_step: int | None = None  # the optimizer step whose weights the servers hold
        self._closed = False

    def version_of(self, global_step: int) -> int:
        """The weight version step ``global_step`` trains (and, once pushed, the servers hold)."""
        return global_step // self.sync_every_steps

    @property
    def ver(self) -> int:
        """The version the servers hold: that of the last completed push (every rank knows it)."""
        return self.backend.weight_version

    # ------------------------------------------------------------------------------ sync policy
    def before_step(self, global_step: int, kind: StepKind | None) -> SyncReport | None:
        """Push ``v(global_step)`` if the servers hold another version; the run's first step always
        pushes (a server may hold this version number with another run's weights), then starts the actor."""
        version = self.version_of(global_step)
        report = None
        if not self.actor.started or self.backend.weight_version != version:
            report = self.backend.sync_weights(self.model, version)
            self._weights_step = global_step
        self.actor.set_current_version(self.ver, global_step)
        self.actor.start()
        return report

    @property
    def weights_step(self) -> int | None:
        """The optimizer step whose weights the servers hold (None before the run's first push). With
        ``sync_every_steps > 1`` it may lag the model by up to ``sync_every_steps - 1`` steps."""
        return self._weights_step

    def push_current_weights(self, global_step: int) -> SyncReport | None:
        """Periodic evaluation's push: the servers get the weights after ``global_step`` optimizer steps
        (under version ``v(global_step)``) unless they hold them already, so an evaluation never scores
        weights up to ``sync_every_steps - 1`` steps old. The actor is told the version the servers now
        hold, but neither started nor moved to another step; rollouts it makes from these weights carry
        that version (they are fresher than it says, never staler)."""
        if self._weights_step == global_step:
            return None
        report = self.backend.sync_weights(self.model, self.version_of(global_step))
        self._weights_step = global_step
        self.actor.set_current_version(self.ver)
        return report

    # ---------------------------------------------------------------------------------- channel
    def reserve_for_step(self, global_step: int, micro_steps: int, *, wants_b: bool) -> ChannelStatus:
        """This rank's eligible packs under ``ver`` (stale ones dropped); a step that wants B waits up to
        ``max_wait_s`` for enough and reserves them."""
        self.queue.unreserve()  # packs a previous vote reserved for a step that ran Channel-A
        version = self.ver
        self.queue.drop_stale(version, self.version_window)
        if wants_b and self.queue.eligible(version, self.version_window) < micro_steps:
            self.actor.flush_waiting()
            self.queue.drop_stale(version, self.version_window)
        if wants_b and self.max_wait_s > 0:
            self._wait_for_packs(version, micro_steps)
        if self.actor.failure is not None:
            return ChannelStatus(failure=f"rollout actor: {self.actor.failure}")
        if not wants_b:
            return ChannelStatus(ready=self.queue.eligible(version, self.version_window))
        return ChannelStatus(ready=self.queue.reserve(micro_steps, version, self.version_window))

    def _wait_for_packs(self, version: int, micro_steps: int) -> None:
        """Up to ``max_wait_s`` until ``micro_steps`` packs are eligible under ``version`` (or the actor
        failed, or the scheduler's warning came: the checkpoint it asks for is saved at this step's end,
        within one wait slice instead of after ``max_wait_s``). Meanwhile the actor completes the partial
        pack that used the last of its admission room: with no later B step in the window no rollout may
        be admitted to fill it (window 0)."""
        deadline = time.monotonic() + self.max_wait_s
        self.actor.set_step_waiting(True)
        try:
            while (
                self.queue.eligible(version, self.version_window) < micro_steps and self.actor.failure is None
            ):
                if warning_received():
                    log.warning(
                        "warning signal (SIGUSR1): stopped waiting for Channel-B packs after %.1fs of "
                        "max_wait_s %.0fs; this step trains what is ready, then checkpoints",
                        self.max_wait_s - (deadline - time.monotonic()),
                        self.max_wait_s,
                    )
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self.queue.wait_for_change(min(remaining, _WAIT_SLICE_S))
                self.queue.drop_stale(version, self.version_window)
        finally:
            self.actor.set_step_waiting(False)

    def take(self, windows: Windows, global_step: int, *, final: bool) -> ChannelBatch:
        version = self.ver
        packs = self.queue.take_reserved(len(windows))
        rows = [pack.segments for pack in packs]
        lags = [version - pack.version for pack in packs]
        sums: Counter[str] = Counter()
        sums[f"{_PREFIX}/packs_trained"] += len(packs)
        sums[f"{_PREFIX}/ver_lag_sum"] += sum(lags)
        sums["samples"] += sum(len(row) for row in rows)
        self.rows.count(rows, sums)
        self.actor.stream.ledger.mark_done([o.stream_position for pack in packs for o in pack.origins])
        self._trace(global_step, "trained", [(o, pack.version) for pack in packs for o in pack.origins])
        return ChannelBatch(
            rows=rows,
            batch=self.rows.batch,
            sums=sums,
            gauges={f"{_PREFIX}/ver_lag_max": ("max", max(lags))},
            trained=self.queue.mark_trained,  # a pack counts as trained after its backward pass
        )

    def finish_step(self, global_step: int) -> tuple[Counter[str], dict[str, tuple[GaugeKind, float]]]:
        """Every step, A or B: move the actor to the next step, mark the records of packs dropped since
        the last step done in the ledger (and trace them); return the actor's rollout metrics since the
        last step and the queue's state."""
        self.actor.set_current_version(self.ver, global_step + 1)  # this step took its packs (or ran A)
        self._last_step = global_step
        dropped = self.queue.take_dropped_origins()
        self.actor.stream.ledger.mark_done([o.stream_position for o in dropped])
        self._trace(global_step, "dropped", [(o, None) for o in dropped])
        sums = self.actor.take_sums()
        del sums["samples"]  # rollouts made, not trained: `samples` counts what the step trains (take)
        pusher_sums = getattr(self.backend, "take_server_sums", None)
        if pusher_sums is not None:  # servers the learner's pushes marked down count as failovers too
            sums.update(pusher_sums())
        sums[f"{_PREFIX}/b_step_skipped_due_to_queue"] += 0  # logged every step; the planner adds the 1
        now, rollouts = time.perf_counter(), self.actor.rollouts_total
        then, before = self._last_report
        self._last_report = (now, rollouts)
        counts = self.queue.counts
        gauges: dict[str, tuple[GaugeKind, float]] = {
            f"{_PREFIX}/ver": ("first", float(self.ver)),
            f"{_PREFIX}/queue_depth": ("spread", float(self.queue.ready)),  # not the packs in training
            f"{_PREFIX}/rollouts_per_s": ("sum", (rollouts - before) / max(now - then, 1e-9)),
            f"{_PREFIX}/packs_produced_total": ("sum", float(counts.produced)),
            f"{_PREFIX}/packs_trained_total": ("sum", float(counts.trained)),
            f"{_PREFIX}/drop_stale_total": ("sum", float(counts.dropped_stale)),
            f"{_PREFIX}/drop_oldest_total": ("sum", float(counts.dropped_oldest)),
            f"{_PREFIX}/rollouts_total": ("sum", float(rollouts)),
            f"{_PREFIX}/rollouts_dropped_stale_total": ("sum", float(counts.rollouts["dropped_stale"])),
            f"{_PREFIX}/admission_wait_s_total": ("sum", self.actor.admission_wait_s),
        }
        return sums, gauges

    def close(self) -> None:
        """Stop the actor (before the weight-sync group closes), count what is left, write the accounting."""
        if self._closed:
            return
        self._closed = True
        self.actor.stop(self.actor_stop_timeout_s)
        self.actor.rollouts.backend.close()
        # The trace ends complete: packs dropped since the last step, then every record still held.
        self._trace(self._last_step, "dropped", [(o, None) for o in self.queue.take_dropped_origins()])
        held = [*self.queue.untaken_origins(), *self.actor.packer.waiting_origins]
        self._trace(self._last_step, "discarded", [(o, None) for o in held])
        left = self.queue.discard_all()
        counts = self.queue.counts
        actor = self.actor
        rollouts = counts.rollouts
        # Rollouts never packed: still in the packer, or returned after the stop flag.
        unpacked = actor.packer.waiting + actor.discarded_after_stop
        discarded = rollouts["discarded"] + unpacked
        accounting = {
            "rank": actor.rank,
            "produced": counts.produced,
            "trained": counts.trained,
            "dropped_stale": counts.dropped_stale,
            "dropped_oldest": counts.dropped_oldest,
            "discarded_at_exit": counts.discarded,
            "balance": counts.balance(len(self.queue)),
            "rollouts": {
                "rolled_out": actor.rollouts_total,
                "trained": rollouts["trained"],
                "dropped_stale": rollouts["dropped_stale"],
                "dropped_oldest": rollouts["dropped_oldest"],
                "discarded_at_exit": discarded,
                "balance": actor.rollouts_total
                - (rollouts["trained"] + rollouts["dropped_stale"] + rollouts["dropped_oldest"] + discarded),
                "stale_dropped_fraction": round(rollouts["dropped_stale"] / max(actor.rollouts_total, 1), 4),
            },
            "admission_wait_s": round(actor.admission_wait_s, 3),
            "actor_busy_seconds": round(actor.busy_seconds, 3),
            "actor_failure": actor.failure,
        }
        log.info(
            "async actor-learner on rank %d stopped: %s (%d packs left in the queue)",
            self.actor.rank,
            accounting,
            left,
        )
        if self.accounting_path is not None:
            os.makedirs(os.path.dirname(self.accounting_path) or ".", exist_ok=True)
            with open(self.accounting_path, "w") as fh:
                json.dump(accounting, fh, indent=1)

    def _trace(self, global_step: int, event: str, records: list[tuple[SegmentOrigin, int | None]]) -> None:
        if self.trace_path is None or not records:
            return
        os.makedirs(os.path.dirname(self.trace_path) or ".", exist_ok=True)
        line = {
            "step": global_step,
            "event": event,
            "records": [[o.stream_position, o.record_id, version] for o, version in records],
        }
        with open(self.trace_path, "a") as fh:
            fh.write(json.dumps(line) + "\n")

    # -------------------------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        """The record stream's ledger (queues are stale after a restart and are not saved)."""
        return {"ledger": self.actor.stream.ledger.state_dict()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is None:
            return
        ledger = StreamLedger.from_state(state["ledger"])
        self.actor.stream.ledger = ledger
        self.actor.stream.position = ledger.frontier
