"""Channel-B ``async`` mode: the learner side of the async actor-learner.

Owns :class:`AsyncPacks`, which is both the Channel-B strategy and the weight-sync policy of an async
run (they share one notion of the weight version):

- **versions**: ``ver = global_step // sync_every_steps``, so rank 0's sync counter is known to every rank
  at every optimizer-step start without a message, and a resumed run continues it. Before step ``s`` the
  servers are pushed ``ver(s)`` whenever it changed (and once at the start of every run, before the
  actors start, so no rollout comes from weights the learner no longer has).
- **status**: stale packs (``ver_pack < ver - version_window``) are dropped and counted; the rank waits up
  to ``max_wait_s`` for one eligible pack per micro-step, then reports how many it holds. The planner runs
  B only if every rank holds one per micro-step.
- **take**: a B step pops exactly one pack per micro-step (one packed row each: DDP lock-step).

Every step it also reports the queue (depth per rank, cumulative produced / trained / dropped counts) and
the actor's rollout metrics. Leaves out: the actor thread (``training.actor``), the queue and packs
(``training.ready_packs``).
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
from rollmatch.training.actor import RolloutActor
from rollmatch.training.ready_packs import ReadyPackQueue
from rollmatch.training.record_stream import StreamLedger
from rollmatch.training.rows import RowPlanner
from rollmatch.training.schedule import StepKind
from rollmatch.training.step import ChannelBatch, ChannelStatus, GaugeKind, Windows

log = logging.getLogger(__name__)
_PREFIX = "stage2_ab/async"
_STOP_TIMEOUT_S = 10.0
_WAIT_SLICE_S = 0.5


class AsyncPacks:
    """Ready packs of this rank's actor, consumed at optimizer-step boundaries (see the module docstring)."""

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
        self._first_push: SyncReport | None = None
        self._last_report = (time.perf_counter(), 0)  # (time, actor rollouts) at the previous step
        self._closed = False

    def version_of(self, global_step: int) -> int:
        return global_step // self.sync_every_steps

    # ------------------------------------------------------------------------------ sync policy
    def before_step(self, global_step: int, kind: StepKind) -> SyncReport | None:
        """Push ``ver(global_step)`` if the servers hold another version (the run's first push is in ``status``)."""
        report, self._first_push = self._first_push, None
        if self.backend.weight_version != self.version_of(global_step):
            report = self.backend.sync_weights(self.model, self.version_of(global_step))
        return report

    # ---------------------------------------------------------------------------------- channel
    def status(self, global_step: int, micro_steps: int, *, wants_b: bool) -> ChannelStatus:
        """This rank's eligible packs (after dropping stale ones); a step that wants B waits up to
        ``max_wait_s`` for enough."""
        self._start(global_step)
        version = self.version_of(global_step)
        self.actor.set_current_version(version)
        self.queue.drop_stale(version, self.version_window)
        deadline = time.monotonic() + (self.max_wait_s if wants_b else 0.0)
        while len(self.queue) < micro_steps and self.actor.failure is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self.queue.wait_for_change(min(remaining, _WAIT_SLICE_S))
            self.queue.drop_stale(version, self.version_window)
        if self.actor.failure is not None:
            return ChannelStatus(failure=f"rollout actor: {self.actor.failure}")
        return ChannelStatus(ready=len(self.queue))

    def _start(self, global_step: int) -> None:
        """First step of the run (all ranks): push this run's weights, then start the actor."""
        if self.actor.started:
            return
        version = self.version_of(global_step)
        # Always push: a server may hold this version number with another run's weights.
        self._first_push = self.backend.sync_weights(self.model, version)
        self.actor.set_current_version(version)
        self.actor.start()

    def take(self, windows: Windows, global_step: int, *, final: bool) -> ChannelBatch:
        version = self.version_of(global_step)
        packs = self.queue.take_eligible(len(windows), version, self.version_window)
        rows = [pack.segments for pack in packs]
        lags = [version - pack.version for pack in packs]
        sums: Counter[str] = Counter()
        sums[f"{_PREFIX}/packs_trained"] += len(packs)
        sums[f"{_PREFIX}/ver_lag_sum"] += sum(lags)
        sums["samples"] += sum(len(row) for row in rows)
        self.rows.count(rows, sums)
        self.actor.stream.ledger.mark_done([o.stream_position for pack in packs for o in pack.origins])
        return ChannelBatch(
            rows=rows, batch=self.rows.batch, sums=sums, gauges={f"{_PREFIX}/ver_lag_max": ("max", max(lags))}
        )

    def step_metrics(self, global_step: int) -> tuple[Counter[str], dict[str, tuple[GaugeKind, float]]]:
        """Every step, A or B: the actor's rollout metrics since the last step and the queue's state."""
        dropped = self.queue.take_dropped_origins()
        self.actor.stream.ledger.mark_done([o.stream_position for o in dropped])
        sums = self.actor.take_sums()
        del sums["samples"]  # rollouts made, not trained: `samples` counts what the step trains (take)
        sums[f"{_PREFIX}/b_step_skipped_due_to_queue"] += 0  # logged every step; the planner adds the 1
        now, rollouts = time.perf_counter(), self.actor.rollouts_total
        then, before = self._last_report
        self._last_report = (now, rollouts)
        counts = self.queue.counts
        gauges: dict[str, tuple[GaugeKind, float]] = {
            f"{_PREFIX}/ver": ("first", float(self.version_of(global_step))),
            f"{_PREFIX}/queue_depth": ("spread", float(len(self.queue))),
            f"{_PREFIX}/rollouts_per_s": ("sum", (rollouts - before) / max(now - then, 1e-9)),
            f"{_PREFIX}/packs_produced_total": ("sum", float(counts.produced)),
            f"{_PREFIX}/packs_trained_total": ("sum", float(counts.trained)),
            f"{_PREFIX}/drop_stale_total": ("sum", float(counts.dropped_stale)),
            f"{_PREFIX}/drop_oldest_total": ("sum", float(counts.dropped_oldest)),
        }
        return sums, gauges

    def close(self) -> None:
        """Stop the actor (before the weight-sync group closes), count what is left, write the accounting."""
        if self._closed:
            return
        self._closed = True
        self.actor.stop(_STOP_TIMEOUT_S)
        self.actor.rollouts.backend.close()
        left = self.queue.discard_all()
        counts = self.queue.counts
        accounting = {
            "rank": self.actor.rank,
            "produced": counts.produced,
            "trained": counts.trained,
            "dropped_stale": counts.dropped_stale,
            "dropped_oldest": counts.dropped_oldest,
            "discarded_at_exit": counts.discarded,
            "balance": counts.balance(len(self.queue)),
            "rollouts": self.actor.rollouts_total,
            "actor_busy_seconds": round(self.actor.busy_seconds, 3),
            "actor_failure": self.actor.failure,
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
