"""Channel-B ``step`` mode: a budget of raw rollouts per optimizer step, learned to completion.

Owns: which records a step rolls out (:class:`StepRecordStream`: the window's records, cut to or
topped up to this rank's share of ``stage2_ab.channel_b.rollouts_per_step``), the step's B loop
(:class:`StepLearner`: rollouts in decode batches -> segments -> a variable number of packed rows ->
one forward/backward per row, normalised over the whole step), the optional in-step pipeline
(``enable_pipeline``: a bounded queue of size 1 between a rollout thread and the learner), and the
micro-steps that put the loop on the last micro-step of the window (:class:`StepModeWindows`).
Leaves out: the A/B decision (``training.schedule`` / ``training.stage2``), how one chunk of
records becomes segments (``training.channels``) and the optimizer update (HF's loop, once per step).

How a step runs: HF's sampler still yields ``per_device_train_batch_size`` records per micro-step.
The first micro-steps of the window only buffer their records (no forward, zero loss); the last
one rolls out the step's records and trains every segment they produce. Every segment is trained
in the step that rolled it out (no carry-over), so rows vary in number. When the budget share is
larger than the window's records, the rest comes from a dedicated per-rank stream over the training
records (seeded per epoch of that stream, positioned by the optimizer step, so resume replays it);
when it is smaller, the window's first records are used and the others are skipped this epoch.

Normalisation: without the pipeline all segments exist before the first row, so each row's loss is
``sum(w * ce) / W_step`` exactly as in ``compute_loss``. With the pipeline rows are trained while
rollouts still arrive: each row is divided by a provisional normaliser (the weight seen when the
first row trained) and the gradients are rescaled by ``provisional / W_step`` once the step ends.
"""

from __future__ import annotations

import functools
import queue
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rollmatch.config.schema import ChannelBConfig, TrainingConfig
from rollmatch.data.records import Record
from rollmatch.errors import BackendError, DataError, PackingError
from rollmatch.packing.binpack import plan_rows, select_row
from rollmatch.packing.collate import pack_row, pad_batch
from rollmatch.packing.segment import Segment
from rollmatch.training.channels import ChannelOutput
from rollmatch.training.schedule import fixed_size_chunks
from rollmatch.training.window import MicroBatch, Window

if TYPE_CHECKING:
    from rollmatch.training.trainer import RollmatchTrainer

# (records of one rollout call, optimizer step, index of its first record in the step) -> segments
ChunkProducer = Callable[[Sequence[Record], int, int], ChannelOutput]
# (one row or padded batch, normaliser) -> detached ``sum(w * ce) / normaliser``, after its backward
RowTrainer = Callable[[MicroBatch, float], torch.Tensor]


def rollouts_per_step(channel_b: ChannelBConfig, training: TrainingConfig, world_size: int, gas: int) -> int:
    """The global raw-rollout budget of one step (all ranks together).

    ``channel_b.rollouts_per_step``, or by default ``per_device_train_batch_size * world_size * gas``.
    With ``training.effective_batch_size`` the derived ``gas`` is a ceiling, so the default may
    exceed the requested effective batch size.
    """
    if channel_b.rollouts_per_step is not None:
        return channel_b.rollouts_per_step
    return training.per_device_train_batch_size * world_size * gas


def rank_share(total: int, rank: int, world_size: int) -> int:
    """This rank's deterministic share of ``total`` rollouts; the shares of all ranks sum to ``total``."""
    return total // world_size + (1 if rank < total % world_size else 0)


def extra_record_indices(
    global_step: int, count: int, *, stride: int, num_records: int, seed: int, rank: int
) -> list[int]:
    """Indices of the ``count`` records a step tops its budget up with, from a per-rank stream.

    The stream is an endless sequence of seeded permutations of ``range(num_records)`` (one per pass);
    step ``s`` reads positions ``s * stride ..`` (``stride`` = the per-step share, an upper bound of
    ``count``), so a step's extra records depend only on the step: resume reproduces them.
    """
    if num_records <= 0:
        raise DataError(
            "step mode needs training records to top up its rollout budget; data.train_jsonl is empty"
        )
    start = global_step * stride
    indices = []
    for position in range(start, start + count):
        epoch, offset = divmod(position, num_records)
        indices.append(_stream_permutation(seed, rank, epoch, num_records)[offset])
    return indices


@functools.lru_cache(maxsize=4)  # consecutive steps read the same pass (or two)
def _stream_permutation(seed: int, rank: int, epoch: int, num_records: int) -> tuple[int, ...]:
    order = list(range(num_records))
    random.Random(f"rollmatch-step-records:{seed}:{rank}:{epoch}").shuffle(order)
    return tuple(order)


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


@dataclass
class StepOutcome:
    """One step's B loop: its loss ``sum(w * ce) / W_step`` and its metric sums."""

    loss: float
    sums: Counter[str] = field(default_factory=Counter)


class StepLearner:
    """Runs the B loop of one optimizer step: decode batches -> segments -> rows -> one pass per row."""

    def __init__(
        self,
        *,
        produce_chunk: ChunkProducer,
        decode_batch_size: int,
        packing: bool,
        packing_length: int,
        batch_size: int,
        pad_token_id: int,
        pipeline: bool,
        wait_timeout_s: float,
    ):
        self.produce_chunk = produce_chunk
        self.decode_batch_size = decode_batch_size
        self.packing = packing
        self.packing_length = packing_length
        self.batch_size = batch_size  # segments per padded batch when packing is off
        self.pad_token_id = pad_token_id
        self.pipeline = pipeline
        self.wait_timeout_s = wait_timeout_s

    def learn(
        self, records: Sequence[Record], global_step: int, train_row: RowTrainer, model: torch.nn.Module
    ) -> StepOutcome:
        """Roll out ``records``, train every segment they give, return the step loss and metric sums."""
        start = time.perf_counter()
        run = _StepRun(self, global_step, train_row)
        if self.pipeline:
            self._learn_pipelined(records, run, model)
        else:
            self._learn_sequential(records, run)
        run.sums["stage2_ab/rollouts"] += len(records)
        run.sums["stage2_ab/step/seconds"] += time.perf_counter() - start
        return StepOutcome(loss=run.loss, sums=run.finish_sums())

    def _learn_sequential(self, records: Sequence[Record], run: _StepRun) -> None:
        wait_start = time.perf_counter()
        segments: list[Segment] = []
        for begin, end in fixed_size_chunks(len(records), self.decode_batch_size):
            out = self.produce_chunk(records[begin:end], run.global_step, begin)
            run.add_output(out)
            segments.extend(out.segments)
        run.sums["stage2_ab/step/learner_wait_s"] += time.perf_counter() - wait_start
        run.normaliser = run.total_weight
        for row in self.rows_of(segments):
            run.train(row)

    def _learn_pipelined(self, records: Sequence[Record], run: _StepRun, model: torch.nn.Module) -> None:
        chunks = fixed_size_chunks(len(records), self.decode_batch_size)
        handoff: queue.Queue[Any] = queue.Queue(maxsize=1)  # at most one produced chunk waits
        stop = threading.Event()
        producer = threading.Thread(
            target=self._produce_into,
            args=(records, chunks, run.global_step, handoff, stop),
            name=f"rollmatch-step{run.global_step}-rollouts",
            daemon=True,
        )
        producer.start()
        pending: list[Segment] = []
        finished = False
        try:
            for index in range(len(chunks)):
                out = self._next_chunk(handoff, run, index, len(chunks))
                run.add_output(out)
                pending.extend(out.segments)
                for row in self._ready_rows(pending):
                    run.train(row)
            done = self._next_chunk(handoff, run, len(chunks), len(chunks))
            if done is not _PRODUCER_DONE:
                raise RuntimeError("step-mode pipeline: the rollout thread produced more chunks than planned")
            for row in self.rows_of(pending):
                run.train(row)
            finished = True
        finally:
            stop.set()
            # Finished: the producer is exiting. Failed: it may be stuck in a backend call; it is a
            # daemon and its result is discarded, so do not hold the error up for it.
            producer.join(timeout=self.wait_timeout_s if finished else 0.1)
        run.rescale_gradients(model)

    def _produce_into(
        self,
        records: Sequence[Record],
        chunks: list[tuple[int, int]],
        global_step: int,
        handoff: queue.Queue[Any],
        stop: threading.Event,
    ) -> None:
        try:
            for begin, end in chunks:
                if stop.is_set():
                    return
                _put_until_stopped(handoff, self.produce_chunk(records[begin:end], global_step, begin), stop)
            _put_until_stopped(handoff, _PRODUCER_DONE, stop)
        except BaseException as exc:  # handed to the learner thread, which re-raises it
            _put_until_stopped(handoff, _ProducerFailed(exc), stop)

    def _next_chunk(self, handoff: queue.Queue[Any], run: _StepRun, index: int, total: int) -> Any:
        wait_start = time.perf_counter()
        try:
            item = handoff.get(timeout=self.wait_timeout_s)
        except queue.Empty:
            raise BackendError(
                f"step-mode pipeline (optimizer step {run.global_step}): no rollouts arrived for "
                f"{self.wait_timeout_s:.0f}s while waiting for decode batch {index + 1}/{total}; the rollout "
                "backend stalled (check the rollout servers, or raise training.collective_timeout_s)"
            ) from None
        run.sums["stage2_ab/step/learner_wait_s"] += time.perf_counter() - wait_start
        if isinstance(item, _ProducerFailed):
            raise item.error
        return item

    def _ready_rows(self, pending: list[Segment]) -> list[list[Segment]]:
        """Rows that can be trained now (removed from ``pending``); the rest waits for more segments."""
        rows: list[list[Segment]] = []
        if not self.packing:
            while len(pending) >= self.batch_size:
                rows.append(pending[: self.batch_size])
                del pending[: self.batch_size]
            return rows
        while sum(s.length for s in pending) >= self.packing_length:
            picked = select_row([s.length for s in pending], self.packing_length)
            rows.append([pending[i] for i in picked])
            for i in reversed(picked):
                del pending[i]
        return rows

    def rows_of(self, segments: Sequence[Segment]) -> list[list[Segment]]:
        """All ``segments`` as rows: packed as full as possible, or padded batches of ``batch_size``."""
        if not self.packing:
            return [list(segments[i : i + self.batch_size]) for i in range(0, len(segments), self.batch_size)]
        return [
            [segments[i] for i in row] for row in plan_rows([s.length for s in segments], self.packing_length)
        ]


class _StepRun:
    """Book-keeping of one step's B loop: normaliser, loss, metric sums."""

    def __init__(self, learner: StepLearner, global_step: int, train_row: RowTrainer):
        self.learner = learner
        self.global_step = global_step
        self.train_row = train_row
        self.total_weight = 0.0
        self.normaliser: float | None = None
        self.scaled_loss: torch.Tensor | float = 0.0  # a device tensor: no host sync per row
        self.sums: Counter[str] = Counter()

    def add_output(self, out: ChannelOutput) -> None:
        self.sums.update(out.sums)
        self.total_weight += sum(s.weight_sum for s in out.segments)

    def train(self, row: list[Segment]) -> None:
        if self.normaliser is None:  # pipeline: provisional, corrected by rescale_gradients
            self.normaliser = self.total_weight
        _require_weight(self.normaliser, self.global_step)
        learner = self.learner
        batch = pack_row(row) if learner.packing else pad_batch(row, learner.pad_token_id)
        self.scaled_loss = self.scaled_loss + self.train_row(batch, self.normaliser)
        self.sums["stage2_ab/step/forward_passes"] += 1
        if learner.packing:
            self.sums["packing/rows"] += 1
            self.sums["packing/segments"] += len(row)
            self.sums["packing/tokens"] += sum(s.length for s in row)
            self.sums["packing/capacity"] += learner.packing_length

    @property
    def loss(self) -> float:
        if self.normaliser is None:
            return 0.0
        return float(self.scaled_loss) * self.normaliser / self.total_weight

    def rescale_gradients(self, model: torch.nn.Module) -> None:
        """Turn the provisional normalisation into the step's: gradients *= provisional / W_step."""
        _require_weight(self.total_weight, self.global_step)
        if self.normaliser is None or self.normaliser == self.total_weight:
            return
        factor = self.normaliser / self.total_weight
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param.grad.mul_(factor)

    def finish_sums(self) -> Counter[str]:
        self.sums["loss/weight"] += self.total_weight
        return self.sums


def _require_weight(weight: float, global_step: int) -> None:
    if weight <= 0:
        raise PackingError(
            f"step-mode optimizer step {global_step} has total loss weight {weight}: no trained token in its "
            "rollout targets (check `loss.*` weights and that targets are not empty)"
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


# ------------------------------------------------------------------------------ micro-steps
class StepModeWindows:
    """Builds a step-mode window: micro-steps that buffer records, the last one runs the B loop."""

    def __init__(self, *, learner: StepLearner, records: StepRecordStream):
        self.learner = learner
        self.records = records

    def build(self, raw_batches: Sequence[Sequence[Record]], global_step: int) -> Window:
        pending = _PendingStep(global_step=global_step, expected=len(raw_batches))
        micro_steps: list[Any] = [StepMicroStep(list(batch), pending, self) for batch in raw_batches]
        # The step's loss weight is known only after its rollouts (inside the last micro-step), so
        # the window carries none; StepMicroStep.run normalises by itself.
        return Window(micro_batches=micro_steps, total_weight=0.0, sums=Counter())

    def run_step(
        self, pending: _PendingStep, trainer: RollmatchTrainer, model: torch.nn.Module
    ) -> StepOutcome:
        records = self.records.select(pending.records, pending.global_step)
        device = trainer.args.device

        def train_row(batch: MicroBatch, normaliser: float) -> torch.Tensor:
            weight = torch.tensor(normaliser, dtype=torch.float64, device=device)
            return trainer.training_step(model, batch, weight)

        outcome = self.learner.learn(records, pending.global_step, train_row, model)
        outcome.sums["stage2_ab/loss_b_sum"] += outcome.loss
        outcome.sums["stage2_ab/steps_b_sum"] += 1
        outcome.sums["stage2_ab/micro_steps_b"] += pending.expected
        return outcome


@dataclass
class _PendingStep:
    """Records buffered by the micro-steps of one step-mode window."""

    global_step: int
    expected: int
    records: list[Record] = field(default_factory=list)
    seen: int = 0


class StepMicroStep:
    """One micro-step of a step-mode window (a ``CustomMicroStep`` of the trainer)."""

    def __init__(self, records: list[Record], pending: _PendingStep, windows: StepModeWindows):
        self.records = records
        self.pending = pending
        self.windows = windows

    def run(self, trainer: RollmatchTrainer, model: torch.nn.Module) -> torch.Tensor:
        pending = self.pending
        pending.records.extend(self.records)
        pending.seen += 1
        if pending.seen < pending.expected:
            return torch.zeros((), device=trainer.args.device)  # buffered: no forward this micro-step
        outcome = self.windows.run_step(pending, trainer, model)
        publish_sums(trainer, outcome.sums)
        return torch.tensor(outcome.loss, device=trainer.args.device)


def publish_sums(trainer: RollmatchTrainer, sums: Counter[str]) -> None:
    """Metric sums produced while a micro-step runs (after the window's gather) join the step's log line.

    The trainer keeps pending sums until its next log, which comes after this optimizer step.
    """
    trainer.add_metric_sums(sums)
