"""Channel-B ``step`` mode: a budget of raw rollouts per optimizer step, learned to completion.

Owns :class:`StepRollouts` (the Channel-B strategy): which records a step rolls out
(:class:`StepRecordStream`: the window's records, cut to or topped up to this rank's share of
``stage2_ab.channel_b.rollouts_per_step``), its rollouts in decode batches, and every segment they
give trained in the same step, nothing carried to the next step. As the spec says for gradient
accumulation, Channel-B runs on the step's **final micro-step** only: the earlier micro-steps buffer
(no pass), and the last one rolls out the whole budget and learns it to completion, as many rows as
the segments need (:class:`DeferredStep`). With ``enable_pipeline`` the rollouts of that last
micro-step stream in on a thread while the rows that are already full train (:class:`PipelinedStep`).
Leaves out: the A/B decision and lock-step rows (``training.step``), how records become segments
(``training.segment_producers``) and the optimizer update (HF's loop, once per step).

Which records: when the budget share is larger than the window's records, the rest comes from a
dedicated per-rank stream over the training records (seeded per pass of that stream, positioned by the
optimizer step, so resume replays it); when it is smaller, the window's first records are used and the
others are skipped this epoch.

Normalisation: without the pipeline all segments exist before the first row, so each row's loss is
``sum(w * ce) / W_step`` exactly as every other step (step mode runs in one process, so the rank's
weight is the step's). With the pipeline rows are trained while rollouts
still arrive: each row is divided by a provisional normaliser (the weight seen when the first row trained)
and the gradients are rescaled by ``provisional / W_step`` once the step ends.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rollmatch.config.schema import ChannelBConfig, TrainingConfig
from rollmatch.data.records import Record
from rollmatch.errors import BackendError, PackingError
from rollmatch.packing.binpack import select_row
from rollmatch.packing.segment import Segment
from rollmatch.training.channel_b.record_stream import extra_record_indices
from rollmatch.training.rows import MicroBatch, RowPlanner
from rollmatch.training.schedule import fixed_size_chunks
from rollmatch.training.segment_producers import ChannelOutput, RolloutSegmentProducer
from rollmatch.training.step import ChannelBatch, ChannelStatus, GaugeKind, MicroStep, Windows

STEP_SECONDS = "stage2_ab/step/seconds"


def rollouts_per_step(
    channel_b: ChannelBConfig, training: TrainingConfig, world_size: int, gas: int, per_record: int = 1
) -> int:
    """The global raw-rollout budget of one step (all ranks together); ``per_record`` rollouts per record.

    ``channel_b.rollouts_per_step``, or by default ``per_device_train_batch_size * world_size * gas *
    per_record`` (``per_device_train_batch_size * world_size * gas`` records). The step rolls out
    ``budget / per_record`` records (a rule keeps the budget a multiple of ``per_record``).
    With ``training.effective_batch_size`` the derived ``gas`` is a ceiling, so the default may
    exceed the requested effective batch size.
    """
    if channel_b.rollouts_per_step is not None:
        return channel_b.rollouts_per_step
    return training.per_device_train_batch_size * world_size * gas * per_record


def rank_share(total: int, rank: int, world_size: int) -> int:
    """This rank's deterministic share of ``total`` rollouts; the shares of all ranks sum to ``total``."""
    return total // world_size + (1 if rank < total % world_size else 0)


class StepRecordStream:
    """The records one step rolls out on this rank: the window's, cut or topped up to the rank's share."""

    def __init__(self, pool: Sequence[Record], *, share: int, seed: int, rank: int):
        self.pool = list(pool)
        self.share = share
        self.seed = seed
        self.rank = rank

    def select(self, window_records: Sequence[Record], global_step: int) -> list[Record]:
        if len(window_records) >= self.share:
            return list(window_records[: self.share])
        extra = extra_record_indices(
            global_step,
            self.share - len(window_records),
            stride=self.share,
            num_records=len(self.pool),
            seed=self.seed,
            rank=self.rank,
        )
        return [*window_records, *(self.pool[i] for i in extra)]


class StepRollouts:
    """Channel-B step mode (see the module docstring)."""

    def __init__(
        self,
        *,
        rollouts: RolloutSegmentProducer,
        rows: RowPlanner,
        records: StepRecordStream,
        batch_size: int,
        pipeline: bool,
        wait_timeout_s: float,
    ):
        self.rollouts = rollouts
        self.rows = rows
        self.records = records
        self.batch_size = batch_size  # segments per padded batch when packing is off
        self.pipeline = pipeline
        self.wait_timeout_s = wait_timeout_s

    always_ready = True  # every step rolls out its own records

    def reserve_for_step(self, global_step: int, micro_steps: int, *, wants_b: bool) -> ChannelStatus:
        return ChannelStatus()

    def take(self, windows: Windows, global_step: int, *, final: bool) -> ChannelBatch:
        records = self.records.select([r for window in windows for r in window], global_step)
        last = PipelinedStep if self.pipeline else DeferredStep
        lazy = last(self, records, step=global_step, index=len(windows), count=len(windows))
        return ChannelBatch(rows=[], batch=self.rows.batch, lazy=lazy, timing_key=STEP_SECONDS)

    def finish_step(self, global_step: int) -> tuple[Counter[str], dict[str, tuple[GaugeKind, float]]]:
        return Counter(), {}

    def close(self) -> None:
        return None

    def log_trained(self, global_step: int, segments: Sequence[Segment]) -> None:
        """Every segment a step-mode step rolls out, it trains: the rollout log sees them as they come."""
        if self.rollouts.rollout_log is not None:
            self.rollouts.rollout_log.trained(global_step, segments)


class DeferredStep(MicroStep):
    """The last micro-step of a step-mode step: rolls out the whole budget, then trains every row."""

    def __init__(self, owner: StepRollouts, records: Sequence[Record], *, step: int, index: int, count: int):
        super().__init__([], kind="B", step=step, index=index, count=count)
        self.owner = owner
        self.records = list(records)
        self.total_weight = 0.0
        per_record = owner.rollouts.rollouts_per_record
        self.sums: Counter[str] = Counter({"stage2_ab/rollouts": len(records) * per_record})

    def passes(self, step_weight: float) -> Iterator[tuple[MicroBatch, float]]:
        owner = self.owner
        wait_start = time.perf_counter()
        produced = owner.rollouts.produce(self.records, self.step)
        owner.log_trained(self.step, produced.segments)
        self.sums.update(produced.sums)
        self.sums["stage2_ab/step/learner_wait_s"] += time.perf_counter() - wait_start
        self.total_weight = sum(s.weight_sum for s in produced.segments)
        self.sums["target/supervised_tokens"] += sum(s.supervised_tokens for s in produced.segments)
        _require_weight(self.total_weight, self.step)
        rows = owner.rows.all_rows(produced.segments, owner.batch_size)
        self.sums["stage2_ab/step/forward_passes"] += len(rows)
        owner.rows.count(rows, self.sums)
        for row in rows:
            yield owner.rows.batch(row), self.total_weight

    def finish(self, model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
        self.sums["loss/weight"] += self.total_weight
        return loss

    def local_sums(self) -> Counter[str]:
        return self.sums


class PipelinedStep(DeferredStep):
    """The last micro-step of a pipelined step-mode step: rows are trained while rollouts still arrive.

    A rollout thread produces one decode batch at a time into a queue of size 1; rows are formed
    greedily as soon as a full row's worth of segments waits, the rest when the rollouts are done.
    """

    def __init__(self, owner: StepRollouts, records: Sequence[Record], *, step: int, index: int, count: int):
        super().__init__(owner, records, step=step, index=index, count=count)
        self.normaliser: float | None = None  # provisional: the weight seen when the first row trained

    def passes(self, step_weight: float) -> Iterator[tuple[MicroBatch, float]]:
        owner = self.owner
        size = owner.rollouts.decode_batch_size or max(len(self.records), 1)
        chunks = fixed_size_chunks(len(self.records), size)
        handoff: queue.Queue[Any] = queue.Queue(maxsize=1)  # at most one produced chunk waits
        stop = threading.Event()
        producer = threading.Thread(
            target=self._produce_into,
            args=(chunks, handoff, stop),
            name=f"rollmatch-step{self.step}-rollouts",
            daemon=True,
        )
        producer.start()
        pending: list[Segment] = []
        finished = False
        try:
            for index in range(len(chunks)):
                self._add(self._next_chunk(handoff, index, len(chunks)), pending)
                for row in self._ready_rows(pending):
                    yield self._row(row)
            if self._next_chunk(handoff, len(chunks), len(chunks)) is not _PRODUCER_DONE:
                raise RuntimeError("step-mode pipeline: the rollout thread produced more chunks than planned")
            for row in owner.rows.all_rows(pending, owner.batch_size):
                yield self._row(row)
            finished = True
        finally:
            stop.set()
            # Finished: the producer is exiting. Failed: it may be stuck in a backend call; it is a
            # daemon and its result is discarded, so do not hold the error up for it.
            producer.join(timeout=owner.wait_timeout_s if finished else 0.1)

    def finish(self, model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
        """Turn the provisional normalisation into the step's: gradients and loss *= provisional / W_step."""
        _require_weight(self.total_weight, self.step)
        self.sums["loss/weight"] += self.total_weight
        if self.normaliser is None or self.normaliser == self.total_weight:
            return loss
        factor = self.normaliser / self.total_weight
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param.grad.mul_(factor)
        return loss * factor

    # ------------------------------------------------------------------------------- internals
    def _produce_into(
        self, chunks: list[tuple[int, int]], handoff: queue.Queue[Any], stop: threading.Event
    ) -> None:
        try:
            for begin, end in chunks:
                if stop.is_set():
                    return
                out = self.owner.rollouts.produce_chunk(self.records[begin:end], self.step, begin)
                _put_until_stopped(handoff, out, stop)
            _put_until_stopped(handoff, _PRODUCER_DONE, stop)
        except BaseException as exc:  # handed to the learner thread, which re-raises it
            _put_until_stopped(handoff, _ProducerFailed(exc), stop)

    def _next_chunk(self, handoff: queue.Queue[Any], index: int, total: int) -> Any:
        wait_start = time.perf_counter()
        timeout = self.owner.wait_timeout_s
        try:
            item = handoff.get(timeout=timeout)
        except queue.Empty:
            raise BackendError(
                f"step-mode pipeline (optimizer step {self.step}): no rollouts arrived for {timeout:.0f}s while "
                f"waiting for decode batch {index + 1}/{total}; the rollout backend stalled (check the rollout "
                "servers, or raise training.collective_timeout_s)"
            ) from None
        self.sums["stage2_ab/step/learner_wait_s"] += time.perf_counter() - wait_start
        if isinstance(item, _ProducerFailed):
            raise item.error
        return item

    def _add(self, out: ChannelOutput, pending: list[Segment]) -> None:
        self.owner.log_trained(self.step, out.segments)
        self.sums.update(out.sums)
        self.total_weight += sum(s.weight_sum for s in out.segments)
        self.sums["target/supervised_tokens"] += sum(s.supervised_tokens for s in out.segments)
        pending.extend(out.segments)

    def _ready_rows(self, pending: list[Segment]) -> list[list[Segment]]:
        """Rows that can be trained now (removed from ``pending``); the rest waits for more segments."""
        owner, rows = self.owner, []
        if owner.rows.carry is None:
            while len(pending) >= owner.batch_size:
                rows.append(pending[: owner.batch_size])
                del pending[: owner.batch_size]
            return rows
        capacity = owner.rows.packing_length
        while sum(s.length for s in pending) >= capacity:
            picked = select_row([s.length for s in pending], capacity)
            rows.append([pending[i] for i in picked])
            for i in reversed(picked):
                del pending[i]
        return rows

    def _row(self, row: list[Segment]) -> tuple[MicroBatch, float]:
        if self.normaliser is None:  # provisional, corrected in finish()
            self.normaliser = self.total_weight
        _require_weight(self.normaliser, self.step)
        self.sums["stage2_ab/step/forward_passes"] += 1
        self.owner.rows.count([row], self.sums)
        return self.owner.rows.batch(row), self.normaliser


def _require_weight(weight: float, global_step: int) -> None:
    if weight <= 0:
        raise PackingError(
            f"step-mode optimizer step {global_step} has total loss weight {weight}: no trained token in its "
            "rollout targets (check `loss.*` weights and that targets are not empty; with "
            "`loss.grpo.mask_truncated_completions: true` a step whose rollouts all hit `max_new_tokens` "
            "trains nothing: raise `custom.extra.rollout_matching.max_new_tokens` or set it false)"
        )


@dataclass
class _ProducerFailed:
    error: BaseException


_PRODUCER_DONE = object()


def _put_until_stopped(handoff: queue.Queue[Any], item: Any, stop: threading.Event) -> None:
    # Short put timeouts so the producer notices when the learner has given up on the step.
    while not stop.is_set():
        try:
            handoff.put(item, timeout=0.1)
            return
        except queue.Full:
            continue
