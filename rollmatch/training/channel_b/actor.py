"""The rollout actor of one learner rank: a background thread that keeps the ready-pack queue fed.

Owns :class:`RolloutActor`: read the rank's record stream, roll the records out on the rollout servers
(a client of its own, never a collective), score them and build segments (``training.segment_producers``), pack
them version-pure (``training.channel_b.ready_packs``) and put the packs into the rank's bounded queue. The actor
paces itself: while ``prefetch_target_packs`` eligible packs wait it sleeps until the learner takes some
or the version moves on; with admission control it also does not start a batch whose packs would be
stale by the step that consumes them (``ready_packs.admission_room``), and while a step waits for packs
it completes the partial pack that used the last of that room (else the step would wait in vain).
Leaves out: the learner's decisions (``training.channel_b.async_mode``) and the record stream itself
(``training.channel_b.record_stream``).

Failure and shutdown: any exception in the thread (a dead or frozen server surfaces as a
:class:`~rollmatch.errors.BackendError` naming its URL, within the client's timeouts) is kept and
reported to the learner, which fails every rank at its next step. ``stop`` sets a flag, wakes the thread
and joins it with a bound; a thread still inside an HTTP call is a daemon and is left to die with the
process (its result is discarded), so shutdown never hangs.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from rollmatch.data.records import Record
from rollmatch.training.channel_b.ready_packs import (
    ReadyPackQueue,
    SegmentOrigin,
    VersionPurePacker,
    admission_room,
)
from rollmatch.training.channel_b.record_stream import RecordStream
from rollmatch.training.segment_producers import RolloutSegmentProducer

log = logging.getLogger(__name__)
_SEED_SPACE = 1 << 31
_IDLE_WAIT_S = 0.5  # pacing: how long the actor sleeps before re-checking when enough packs wait


@dataclass(frozen=True)
class AdmissionSettings:
    """Admission-time staleness control (``stage2_ab.channel_b.async.admission_control``): what the
    actor needs to project when a pack started now would be consumed."""

    sync_every_steps: int
    gradient_accumulation_steps: int
    b_ratio: float  # the schedule's: which steps are Channel-B (each takes one pack per micro-step)


def actor_seed(training_seed: int, rank: int, stream_position: int) -> int:
    """The sampling seed of an actor rollout call whose first record sits at ``stream_position``."""
    digest = hashlib.sha256(f"rollmatch-actor:{training_seed}:{rank}:{stream_position}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % _SEED_SPACE


class RolloutActor:
    """Background producer of version-tagged ready packs for one learner rank."""

    def __init__(
        self,
        *,
        rollouts: RolloutSegmentProducer,
        stream: RecordStream[Record],
        queue: ReadyPackQueue[Any],
        packer: VersionPurePacker[Any],
        decode_batch_size: int,
        prefetch_target: int,
        version_window: int,
        training_seed: int,
        rank: int,
        admission: AdmissionSettings | None = None,
    ):
        self.rollouts = rollouts
        self.stream = stream
        self.queue = queue
        self.packer = packer
        self.decode_batch_size = decode_batch_size
        self.prefetch_target = prefetch_target
        self.version_window = version_window
        self.training_seed = training_seed
        self.rank = rank
        self.admission = admission
        self.current_version = 0
        self.next_step = 0
        self.admission_wait_s = 0.0  # time the actor held back a batch whose packs would arrive stale
        self.failure: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sums_lock = threading.Lock()
        self._packer_lock = threading.Lock()  # the actor adds segments, the learner may flush them
        self._sums: Counter[str] = Counter()  # rollout/match/parse sums since the learner last took them
        self._step_waiting = threading.Event()  # a step is waiting for packs (the learner's max_wait_s)
        self.rollouts_total = 0  # every rollout returned by the servers
        self.discarded_after_stop = 0  # of those, returned after the stop flag: never packed
        self.busy_seconds = 0.0

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._run, name=f"rollmatch-actor-rank{self.rank}", daemon=True
        )
        self._thread.start()
        log.info("rollout actor of rank %d started (weight version %d)", self.rank, self.current_version)

    def set_current_version(self, version: int, next_step: int | None = None) -> None:
        """The version the servers hold and the next optimizer step that takes packs (pacing counts
        only packs eligible under the version; admission control projects from the step)."""
        self.current_version = version
        if next_step is not None:
            self.next_step = next_step
        self.queue.notify()

    def set_step_waiting(self, waiting: bool) -> None:
        """The learner waits for this step's packs (``max_wait_s``) or stopped waiting. While it waits, an
        actor whose admission room is used up by the segments waiting in its packer flushes them into a
        pack at once: no later rollout may be admitted to complete that pack before the step decides."""
        if waiting:
            self._step_waiting.set()
        else:
            self._step_waiting.clear()
        self.queue.notify()

    def flush_waiting(self) -> int:
        """Put the segments waiting in the packer into the queue now, as (under-filled) packs of their
        version; returns how many packs. The learner calls it when a step lacks packs: the waiting
        segments are this step's or lost (a pack of the next version would flush them only after the
        step reserved, and they would expire before the step after)."""
        with self._packer_lock:
            packs = self.packer.flush()
            for pack in packs:
                self.queue.put(pack)
        return len(packs)

    def take_sums(self) -> Counter[str]:
        """Rollout metric sums of everything rolled out since the previous call."""
        with self._sums_lock:
            sums, self._sums = self._sums, Counter()
        return sums

    def stop(self, timeout_s: float) -> bool:
        """Stop and join the thread (at most ``timeout_s``); returns False if it is still stuck in a call."""
        self._stop.set()
        self.queue.notify()
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout=timeout_s)
        if thread.is_alive():
            log.warning(
                "rollout actor of rank %d did not stop within %.0fs (still inside a rollout call); leaving it "
                "to exit with the process",
                self.rank,
                timeout_s,
            )
            return False
        return True

    # --------------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                held = self.queue.eligible(self._next_version(), self.version_window)
                if held >= self.prefetch_target or self.queue.free <= 0:  # enough ready, or no room
                    self.queue.wait_for_change(_IDLE_WAIT_S)
                    continue
                admitted = self._admitted_rollouts(held)
                if admitted == 0 and self._step_waiting.is_set() and self.flush_waiting():
                    continue  # the waiting step's last pack was the partial one (``set_step_waiting``)
                if admitted == 0:
                    started = time.perf_counter()
                    self.queue.wait_for_change(_IDLE_WAIT_S)
                    self.admission_wait_s += time.perf_counter() - started
                    continue
                self._produce_one_batch(admitted)
        except BaseException as exc:  # reported to every rank by the learner at its next step
            self.failure = f"{type(exc).__name__}: {exc}"
            log.error("rollout actor of rank %d failed: %s", self.rank, self.failure)

    def _next_version(self) -> int:
        """The version the next step that takes packs will judge them by: with admission control the
        projection from that step (packs about to expire do not count as held), else the current one."""
        if self.admission is None:
            return self.current_version
        return max(self.current_version, self.next_step // self.admission.sync_every_steps)

    def _admitted_rollouts(self, held: int) -> int:
        """How many records the next batch may hold: ``decode_batch_size``, or with admission control
        as many as fill the packs that will still be eligible when consumed (0: wait). A short batch
        fills the last slots of the next step instead of making packs that would expire."""
        if self.admission is None:
            return self.decode_batch_size
        per_record = self.rollouts.rollouts_per_record
        room = admission_room(
            # Segments waiting in the packer count as a pack: the learner flushes them when it lacks one,
            # and the actor itself while a step waits for packs (``set_step_waiting``).
            held=held + (1 if self.packer.waiting else 0),
            current_version=self.current_version,
            next_step=self.next_step,
            version_window=self.version_window,
            sync_every_steps=self.admission.sync_every_steps,
            gradient_accumulation_steps=self.admission.gradient_accumulation_steps,
            b_ratio=self.admission.b_ratio,
        )
        if room <= 0:
            return 0
        # Packs per rollout so far (rows hold several rollouts); none yet: a whole batch.
        rolled = self.rollouts_total - self.discarded_after_stop
        packs_per_rollout = self.queue.counts.produced / rolled if rolled else 0.0
        if packs_per_rollout <= 0:
            return self.decode_batch_size
        return max(1, min(self.decode_batch_size, int(room / packs_per_rollout) // per_record))

    def _produce_one_batch(self, size: int) -> None:
        taken = self.stream.take(size)
        positions = [position for position, _ in taken]
        records = [record for _, record in taken]
        start = time.perf_counter()
        out = self.rollouts.roll_out(
            records,
            seed=actor_seed(self.training_seed, self.rank, positions[0]),
            created_step=self.current_version,
        )
        self.busy_seconds += time.perf_counter() - start
        self.rollouts_total += len(out.segments)
        if self._stop.is_set():  # shutting down: the learner no longer takes packs
            self.discarded_after_stop += len(out.segments)
            return
        per_record = self.rollouts.rollouts_per_record
        with self._packer_lock:
            for segment, version, position, record in zip(
                out.segments,
                out.versions,
                [p for p in positions for _ in range(per_record)],
                [r for r in records for _ in range(per_record)],
                strict=True,
            ):
                for pack in self.packer.add(segment, SegmentOrigin(record.id, position), version):
                    self.queue.put(pack)
        with self._sums_lock:
            self._sums.update(out.sums)
