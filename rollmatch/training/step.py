"""One optimizer step, top to bottom: from the window's records to the rows every micro-step trains.

Owns :class:`StepPlanner` — the whole life of a step except the forward/backward passes themselves:

1. **sync** (a policy whose pushes depend only on the step, async) — push first, so everything after
   judges freshness against the version the servers now hold;
2. **kind** — Channel-A (GT teacher forcing) or Channel-B (rollout matching): rank 0's schedule decides
   what the step wants; every rank reports whether its Channel-B source can feed the step (async: eligible
   ready packs, reserved for the step) or why it failed; one gather, so every rank runs the same kind (a
   B step some rank cannot feed runs A) and a rank's failure stops every rank here;
   then **sync** (a policy whose pushes depend on the kind): the engine gets the weights this step's
   rollouts need;
3. **segments** — the channel turns the step into segments: Channel-A encodes GT targets; Channel-B
   rolls out in decode batches, scores (strict parse + Hungarian match) and builds ``prefix + missed GT +
   EOS`` targets — or takes ready packs (async);
4. **rows** — segments -> rows (the channel's own carry buffer; packed or padded);
5. **lock-step** — one gather of every rank's row count, loss weight, metric sums and failure (a rank
   whose channel failed in step 3 or 4 tells every rank here, and they all raise together instead of
   waiting out the collective timeout): the step's exact normaliser ``sum(w)``, and the same number of
   rows per micro-step on every rank (a rank with fewer rows runs zero-weight padding rows);
6. **train** — the trainer runs each :class:`MicroStep` (one forward/backward per row).

Leaves out: what each channel does inside (``training.channel_modes``, ``training.channel_b.step_mode``,
``training.channel_b.async_mode``), the optimizer update and logging (HF's loop, ``training.trainer``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, Protocol

import torch

from rollmatch.collectives import Collectives
from rollmatch.data.records import Record
from rollmatch.errors import BackendError, PackingError
from rollmatch.rollout.types import RolloutBackend, SyncReport
from rollmatch.training.rollout_log import RolloutLog
from rollmatch.training.rows import MicroBatch, Row, padding_row, spread_rows
from rollmatch.training.schedule import StepKind, realized_b_ratio, step_kind

log = logging.getLogger(__name__)

Windows = Sequence[Sequence[Record]]  # the records of each micro-batch of one optimizer step
# How a per-rank gauge is combined over ranks: min/mean/max, the maximum, the sum, or rank 0's value.
GaugeKind = Literal["spread", "max", "sum", "first"]


# ------------------------------------------------------------------------------------ interfaces
@dataclass
class ChannelStatus:
    """Whether a channel can feed a step now: ``ready`` rows (None: always), or the error that stopped it."""

    ready: int | None = None
    failure: str | None = None


@dataclass
class ChannelBatch:
    """What a channel made of one step on this rank: its rows, how to batch them, metric sums."""

    rows: list[Row]
    batch: Callable[[Row], MicroBatch]
    sums: Counter[str] = field(default_factory=Counter)
    gauges: dict[str, tuple[GaugeKind, float]] = field(default_factory=dict)
    lazy: MicroStep | None = None  # rows produced while training (step-mode pipeline): the last micro-step
    timing_key: str | None = None  # log the step's wall time (plan start -> last pass) under this sum
    trained: Callable[[int], None] | None = (
        None  # told, after each micro-step's backward, how many rows it trained
    )


class Channel(Protocol):
    """A source of rows for optimizer steps (Channel-A, or one of the Channel-B modes).

    ``always_ready``: the channel feeds every step from the step's own records, so
    :meth:`reserve_for_step` always answers ``ChannelStatus()``; the same on every rank (a property of
    the mode, not of this rank's state), so the planner may skip the kind vote on it alone.
    """

    always_ready: bool

    def reserve_for_step(self, global_step: int, micro_steps: int, *, wants_b: bool) -> ChannelStatus:
        """Can this rank feed a B step of ``micro_steps`` micro-steps? A source with a queue may wait
        for rows and reserves what it reports for this step (``wants_b``: this rank's reading of the
        schedule, so it waits and reserves only when the step will want them)."""
        ...

    def take(self, windows: Windows, global_step: int, *, final: bool) -> ChannelBatch: ...

    def finish_step(self, global_step: int) -> tuple[Counter[str], dict[str, tuple[GaugeKind, float]]]:
        """Close step ``global_step`` on this rank (whichever channel trained it) and return the sums and
        gauges to log for it; a source with a queue settles what the step left (async: moves the actor
        to the next step, marks dropped records done in the ledger)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class KindVote:
    """One rank's part of the kind vote: rank 0's wanted kind (None elsewhere) and its channel status."""

    wanted: StepKind | None
    ready: int | None
    failure: str | None


@dataclass(frozen=True)
class RankStepView:
    """One rank's part of the lock-step gather: its metric sums and gauges, row count and failure."""

    sums: dict[str, float]
    rows: int
    gauges: dict[str, tuple[GaugeKind, float]]
    failure: str | None


class SyncPolicy(Protocol):
    """When the rollout engine gets new weights, and which version they carry.

    ``needs_kind``: True when a push depends on the step's kind (it runs after the kind vote); False when
    it depends only on the step (it runs before the vote, and ``before_step`` gets ``kind=None``).
    """

    needs_kind: bool

    def before_step(self, global_step: int, kind: StepKind | None) -> SyncReport | None: ...

    def push_current_weights(self, global_step: int) -> SyncReport | None:
        """Make the engine serve the weights after ``global_step`` optimizer steps (periodic evaluation's
        push): a push unless it holds them already; no other side effect (the step loop's state is left
        alone)."""
        ...


class Schedule(Protocol):
    """Which kind optimizer step ``s`` wants (``constant``: the same for every step)."""

    constant: StepKind | None
    b_ratio: float

    def wants(self, global_step: int) -> StepKind: ...


# ----------------------------------------------------------------------------------- micro-steps
class MicroStep:
    """The rows one micro-step trains on this rank; each is one forward/backward.

    ``passes`` yields ``(batch, normaliser)``; the normaliser is the step's total loss weight (all
    micro-steps and ranks). ``finish`` runs after the last pass and returns the micro-step's loss.
    """

    def __init__(
        self,
        rows: list[MicroBatch],
        *,
        kind: StepKind,
        step: int,
        index: int,
        count: int,
        trained: Callable[[], None] | None = None,
    ):
        self.rows = rows
        self.kind = kind
        self.step = step
        self.index = index  # 1-based position in the optimizer step
        self.count = count
        self._trained = trained  # the channel's bookkeeping once this micro-step's backward is done

    def passes(self, step_weight: float) -> Iterator[tuple[MicroBatch, float]]:
        for row in self.rows:
            yield row, step_weight

    def finish(self, model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
        """Called after the micro-step's last backward pass."""
        if self._trained is not None:
            self._trained()
        return loss

    def local_sums(self) -> Counter[str]:
        """Metric sums known only after training (this rank's; reduced over ranks at log time)."""
        return Counter()


@dataclass
class StepPlan:
    """One optimizer step as the trainer runs it."""

    kind: StepKind
    micro_steps: list[MicroStep]
    total_weight: float
    sums: Counter[str]  # additive over steps (already summed over ranks)
    gauges: dict[str, float]  # last value wins
    timing_key: str | None = None
    started_at: float = 0.0  # time.perf_counter() when planning began


# ----------------------------------------------------------------------------------- the planner
class StepPlanner:
    """Plans every optimizer step (see the module docstring for the order of things)."""

    def __init__(
        self,
        *,
        schedule: Schedule,
        channel_a: Channel | None,
        channel_b: Channel | None,
        sync: SyncPolicy | None,
        collectives: Collectives,
        report_ab: bool,
        rollout_log: RolloutLog | None = None,
    ):
        self.schedule = schedule
        self.channel_a = channel_a
        self.channel_b = channel_b
        self.sync = sync
        self.collectives = collectives
        self.report_ab = report_ab  # stage2_ab/* metrics (stage2_ab_training only)
        self.rollout_log = rollout_log  # told what each Channel-B step trains (rows known at take)

    def plan(self, windows: Windows, global_step: int, *, final: bool = False) -> StepPlan:
        """Everything before the forward/backward passes of optimizer step ``global_step``."""
        started = time.perf_counter()
        report = None
        if self.sync is not None and not self.sync.needs_kind:
            report = self.sync.before_step(global_step, None)
        kind, skipped = self.vote_kind(global_step, len(windows))
        if self.sync is not None and self.sync.needs_kind:
            report = self.sync.before_step(global_step, kind)
        channel = self.channel_b if kind == "B" else self.channel_a
        if channel is None:
            raise RuntimeError(
                f"optimizer step {global_step} is Channel-{kind}, which this trainer has not built"
            )
        failure: BaseException | None = None
        try:
            batch = channel.take(windows, global_step, final=final)
            if kind == "B" and self.rollout_log is not None:
                self.rollout_log.trained(global_step, [segment for row in batch.rows for segment in row])
            if self.channel_b is not None:
                sums, gauges = self.channel_b.finish_step(global_step)
                batch.sums.update(sums)
                batch.gauges.update(gauges)
        except Exception as exc:  # told to every rank in the lock-step gather below, then raised here
            failure, batch = exc, ChannelBatch(rows=[], batch=_no_rows)
        plan = self._lock_step(kind, batch, windows, global_step, failure)
        plan.timing_key, plan.started_at = batch.timing_key, started
        if report is not None:
            plan.sums.update(
                {"sync/seconds": report.seconds, "sync/bytes": report.num_bytes, "sync/pushes": 1}
            )
            plan.gauges["sync/version"] = float(report.version)
        if self.report_ab:
            self._ab_sums(plan, global_step, skipped)
        log.debug("step %d: Channel-%s, %d micro-steps", global_step, kind, len(plan.micro_steps))
        return plan

    def vote_kind(self, global_step: int, micro_steps: int) -> tuple[StepKind, bool]:
        """The step's kind, the same on every rank; ``True`` when a wanted B step runs A (no packs).

        A collective (one all-gather of every rank's reservation) unless the schedule is constant and the
        Channel-B source always ready: that skip is decided from the schedule and the channel's mode
        alone, never from this rank's state, so every rank skips or votes alike.
        """
        if self.channel_b is None:
            return "A", False  # sft
        constant = self.schedule.constant
        if constant is not None and self.channel_b.always_ready:
            return constant, False  # the same kind every step and nothing to wait for: no vote
        status = self.channel_b.reserve_for_step(
            global_step, micro_steps, wants_b=self.schedule.wants(global_step) == "B"
        )
        wanted = self.schedule.wants(global_step) if self.collectives.is_main else None
        votes: list[KindVote] = self.collectives.all_gather_object(
            KindVote(wanted, status.ready, status.failure), f"step {global_step}: agree on the channel"
        )
        failures = [f"rank {rank}: {vote.failure}" for rank, vote in enumerate(votes) if vote.failure]
        if failures:
            raise BackendError(
                f"the Channel-B rollout source failed before optimizer step {global_step}: "
                + "; ".join(failures)
            )
        kind = votes[0].wanted  # rank 0's schedule decides
        assert kind is not None  # rank 0 always says what it wants
        if kind == "B" and any(vote.ready is not None and vote.ready < micro_steps for vote in votes):
            return "A", True  # some rank cannot feed every micro-step with a ready pack
        return kind, False

    def close(self) -> None:
        for channel in (self.channel_b, self.channel_a):
            if channel is not None:
                channel.close()

    # ------------------------------------------------------------------------------- internals
    def _lock_step(
        self,
        kind: StepKind,
        batch: ChannelBatch,
        windows: Windows,
        global_step: int,
        failure: BaseException | None = None,
    ) -> StepPlan:
        count = len(windows)
        local = Counter(batch.sums)
        local["loss/weight"] += sum(s.weight_sum for row in batch.rows for s in row)
        local["target/supervised_tokens"] += sum(s.supervised_tokens for row in batch.rows for s in row)
        why = None if failure is None else f"{type(failure).__name__}: {failure}"
        gathered: list[RankStepView] = self.collectives.all_gather_object(
            RankStepView(sums=dict(local), rows=len(batch.rows), gauges=batch.gauges, failure=why),
            f"step {global_step}: loss weights and metric sums",
        )
        failed = [f"rank {rank}: {view.failure}" for rank, view in enumerate(gathered) if view.failure]
        if failure is not None:
            raise failure
        if failed:
            raise BackendError(
                f"optimizer step {global_step} (Channel-{kind}) failed on another rank: {'; '.join(failed)}"
            )
        sums: Counter[str] = Counter()
        for rank_view in gathered:
            sums.update(rank_view.sums)
        gauges = combine_gauges([rank_view.gauges for rank_view in gathered])
        if batch.lazy is not None:  # rows arrive while training: that micro-step normalises itself
            empty = [
                MicroStep([], kind=kind, step=global_step, index=i + 1, count=count) for i in range(count - 1)
            ]
            return StepPlan(kind, [*empty, batch.lazy], 0.0, sums, gauges)
        total_weight = float(sums["loss/weight"])
        if total_weight <= 0:
            raise PackingError(
                f"optimizer step {global_step} has total loss weight {total_weight}: no trained token in its "
                "targets (check `loss.*` weights and that targets are not empty; with "
                "`loss.grpo.mask_truncated_completions: true` a step whose rollouts all hit `max_new_tokens` "
                "trains nothing: raise `custom.extra.rollout_matching.max_new_tokens` or set it false)"
            )
        num_rows = max(rank_view.rows for rank_view in gathered)
        if self.collectives.world_size > 1:  # DDP: exactly one forward/backward per micro-step, every rank
            num_rows = max(num_rows, count)
        sums["step/padding_rows"] += sum(num_rows - rank_view.rows for rank_view in gathered)
        rows = list(batch.rows)
        if len(rows) < num_rows:  # keep DDP in lock-step: the same number of passes on every rank
            rows.extend([padding_row(_first_segment(rows, global_step))] * (num_rows - len(rows)))
        micro_steps, start, own = [], 0, len(batch.rows)
        for index, size in enumerate(spread_rows(num_rows, count)):
            micro_rows = [batch.batch(row) for row in rows[start : start + size]]
            trained_here = max(0, min(start + size, own) - start)  # this rank's rows, not padding rows
            start += size
            callback = batch.trained
            micro_steps.append(
                MicroStep(
                    micro_rows,
                    kind=kind,
                    step=global_step,
                    index=index + 1,
                    count=count,
                    trained=None if callback is None else partial(callback, trained_here),
                )
            )
        return StepPlan(kind, micro_steps, total_weight, sums, gauges)

    def _ab_sums(self, plan: StepPlan, global_step: int, skipped: bool) -> None:
        channel = plan.kind.lower()
        plan.sums["stage2_ab/step_kind_b"] += 1.0 if plan.kind == "B" else 0.0
        plan.sums["stage2_ab/b_ratio_realized"] += realized_b_ratio(global_step, self.schedule.b_ratio)
        plan.sums[f"stage2_ab/steps_{channel}_sum"] += 1.0
        plan.sums[f"stage2_ab/micro_steps_{channel}"] += len(plan.micro_steps) * self.collectives.world_size
        if "rollout/count" in plan.sums and "stage2_ab/rollouts" not in plan.sums:
            plan.sums["stage2_ab/rollouts"] += plan.sums["rollout/count"]
        if skipped:
            plan.sums["stage2_ab/async/b_step_skipped_due_to_queue"] += 1.0


def combine_gauges(per_rank: Sequence[dict[str, tuple[GaugeKind, float]]]) -> dict[str, float]:
    """Every rank's gauges -> logged values (``spread`` gives ``_min``, ``_mean`` and ``_max``)."""
    out: dict[str, float] = {}
    for key, (how, _) in per_rank[0].items():
        values = [float(gauges[key][1]) for gauges in per_rank]
        if how == "spread":
            out[f"{key}_min"], out[f"{key}_mean"], out[f"{key}_max"] = (
                min(values),
                sum(values) / len(values),
                max(values),
            )
        elif how == "max":
            out[key] = max(values)
        elif how == "sum":
            out[key] = sum(values)
        else:
            out[key] = values[0]
    return out


def _no_rows(row: Row) -> MicroBatch:
    raise RuntimeError("a failed channel has no rows to batch")


def _first_segment(rows: list[Row], global_step: int) -> Any:
    for row in rows:
        if row:
            return row[0]
    raise PackingError(
        f"optimizer step {global_step}: this rank has no segment to build a padding row from while another "
        "rank trains rows; every rank needs at least one record per optimizer step"
    )


# ------------------------------------------------------------------------------------- schedules
@dataclass
class ConstantSchedule:
    """Every step the same kind: ``sft`` (A) and ``rollout_matching_sft`` (B)."""

    constant: StepKind
    b_ratio: float = 0.0

    def wants(self, global_step: int) -> StepKind:
        return self.constant


@dataclass
class ABSchedule:
    """``stage2_ab.schedule.b_ratio``: step ``s`` wants B iff ``floor((s+1)*r) > floor(s*r)``."""

    b_ratio: float
    constant: None = None

    def wants(self, global_step: int) -> StepKind:
        return step_kind(global_step, self.b_ratio)


# ---------------------------------------------------------------------------------- sync policies
class SyncBeforeRollouts:
    """Push before a Channel-B step if optimizer steps changed the weights since the last push.

    The weight version is the number of optimizer steps applied, so it survives resume.
    """

    needs_kind = True

    def __init__(self, backend: RolloutBackend, model: torch.nn.Module):
        self.backend = backend
        self.model = model

    def before_step(self, global_step: int, kind: StepKind | None) -> SyncReport | None:
        if kind != "B":
            return None  # A steps never roll out, so they never need fresh weights
        return self.push_current_weights(global_step)

    def push_current_weights(self, global_step: int) -> SyncReport | None:
        if self.backend.weight_version == global_step:
            return None
        return self.backend.sync_weights(self.model, global_step)
