"""Ready packs of the async actor-learner: typed queue items, version-pure packing, the bounded queue.

Owns (pure, thread-safe where it says so, no torch.distributed, no HTTP):

- :class:`ReadyPack`: one packed micro-batch (one forward/backward) tagged with the weight version
  its rollouts were generated under (as the rollout server reported it);
- :class:`VersionPurePacker`: turns a stream of version-tagged segments into packs that never mix two
  versions — when a newer version arrives, segments of older versions are flushed into their own packs;
- :class:`ReadyPackQueue`: the per-rank FIFO between the actor thread and the learner: bounded by
  ``queue_limit`` counting reserved and in-training packs (drop-oldest: the oldest weight version
  first, so a late stale pack never evicts a fresh one), stale packs (``ver < current - version_window``) dropped at
  consumption, packs *reserved* for a step once its vote counted them (the actor's drop-oldest can no
  longer evict them, so the step's ``take`` cannot fail), and counters that account for every pack
  produced.

Leaves out: where segments come from (``training.channel_b.actor``) and the step decisions
(``training.step`` / ``training.channel_b.async_mode``).

Accounting invariant (checked by tests and logged at shutdown):
``produced == trained + dropped_stale + dropped_oldest + discarded + len(queue)`` (reserved packs
count in ``len(queue)``).
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from rollmatch.packing.binpack import select_row
from rollmatch.training.schedule import b_steps_before

_LIMIT_KEY = "stage2_ab.channel_b.async.queue_limit"


@dataclass(frozen=True)
class SegmentOrigin:
    """Which record a segment came from: its id and its position in the rank's record stream."""

    record_id: str
    stream_position: int


S = TypeVar("S")  # a segment (anything with a token length); generic so the logic tests without torch


@dataclass
class ReadyPack(Generic[S]):
    """One packed micro-batch ready for one forward/backward, built from rollouts of one weight version."""

    version: int
    segments: list[S]
    tokens: int
    origins: list[SegmentOrigin]
    seq: int = 0  # production order on this rank (set by the queue)


@dataclass
class QueueCounts:
    """Cumulative counters of one rank's queue (every pack produced ends in exactly one of them), in
    packs and, ``rollouts``, in the rollouts (segments) those packs hold."""

    produced: int = 0
    trained: int = 0
    dropped_stale: int = 0
    dropped_oldest: int = 0
    discarded: int = 0  # still queued (or taken but not trained) when the actor-learner shut down
    rollouts: Counter[str] = field(default_factory=Counter)  # the same outcomes, counted in rollouts

    def add(self, outcome: str, packs: list[ReadyPack[Any]]) -> None:
        setattr(self, outcome, getattr(self, outcome) + len(packs))
        self.rollouts[outcome] += sum(len(p.origins) for p in packs)

    def balance(self, depth: int) -> int:
        """``produced - (trained + dropped + discarded + depth)``: 0 when every pack is accounted for
        (``depth``: packs held, queued, reserved or in training)."""
        return self.produced - (
            self.trained + self.dropped_stale + self.dropped_oldest + self.discarded + depth
        )


def is_eligible(pack_version: int, current_version: int, version_window: int) -> bool:
    """The freshness rule: a pack is trainable iff ``current_version - version_window <= pack_version
    <= current_version``. A version above the learner's comes from a server still serving the weights of
    a run the learner resumed behind (a learner-only restart): never trained, dropped like a stale one."""
    return current_version - version_window <= pack_version <= current_version


def admission_room(
    *,
    held: int,
    current_version: int,
    next_step: int,
    version_window: int,
    sync_every_steps: int,
    gradient_accumulation_steps: int,
    b_ratio: float,
) -> int:
    """Admission-time staleness control: how many more packs may the actor start rolling out now?

    Packs rolled out now carry at least ``current_version`` (what the servers hold) and are consumed
    after the ``held`` packs ahead of them by the Channel-B steps from optimizer step ``next_step`` on
    (the next one to take packs), ``gradient_accumulation_steps`` packs each; which steps are B is the
    schedule's (``b_ratio``, deterministic), so a B step's whole need is known, not an average. The
    last step that may still take them is the last whose version (step ``// sync_every_steps``) is
    within ``version_window`` of ``current_version``; the room is what the B steps up to it take, less
    ``held``. A pack beyond it would be generated only to be dropped as stale. 0 or less: wait.
    """
    last_step = (current_version + version_window + 1) * sync_every_steps - 1
    if last_step < next_step or not b_ratio:
        return -held
    b_steps = b_steps_before(last_step + 1, b_ratio) - b_steps_before(next_step, b_ratio)
    return b_steps * gradient_accumulation_steps - held


class VersionPurePacker(Generic[S]):
    """Segments -> version-pure packs of at most ``capacity`` tokens (not thread-safe: one actor owns it).

    Packed mode (``capacity`` set): a pack is taken once the waiting segments of the newest version hold
    at least ``capacity`` tokens, filled by :func:`~rollmatch.packing.binpack.select_row` (oldest pinned,
    best fill). Padded mode (``batch_size`` set): a pack is ``batch_size`` segments in arrival order.
    A segment of a newer version flushes every waiting segment of older versions into their own
    (possibly under-filled) packs first, so no pack ever mixes versions.
    """

    def __init__(self, *, length: Callable[[S], int], capacity: int | None, batch_size: int | None):
        if (capacity is None) == (batch_size is None):
            raise ValueError(
                "VersionPurePacker needs exactly one of capacity (packed) or batch_size (padded)"
            )
        self.length = length
        self.capacity = capacity
        self.batch_size = batch_size
        self._version: int | None = None
        self._waiting: list[tuple[S, SegmentOrigin]] = []

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def waiting_origins(self) -> list[SegmentOrigin]:
        """The records of the waiting segments."""
        return [origin for _, origin in self._waiting]

    def add(self, segment: S, origin: SegmentOrigin, version: int) -> list[ReadyPack[S]]:
        """Add one segment rolled out under ``version``; returns the packs completed by it."""
        packs: list[ReadyPack[S]] = []
        if self._version is not None and version != self._version:
            # Rollouts can come back out of version order only by a server reporting an older version
            # after a newer one (several servers mid-sync); either way the two never share a pack.
            packs.extend(self.flush())
        self._version = version
        self._waiting.append((segment, origin))
        packs.extend(self._full_packs())
        return packs

    def flush(self) -> list[ReadyPack[S]]:
        """Every waiting segment as packs of the current version (the last ones may be under-filled)."""
        packs: list[ReadyPack[S]] = []
        while self._waiting:
            packs.append(self._take())
        return packs

    def _full_packs(self) -> list[ReadyPack[S]]:
        packs: list[ReadyPack[S]] = []
        if self.batch_size is not None:
            while len(self._waiting) >= self.batch_size:
                packs.append(self._take())
            return packs
        assert self.capacity is not None
        while sum(self.length(s) for s, _ in self._waiting) >= self.capacity:
            packs.append(self._take())
        return packs

    def _take(self) -> ReadyPack[S]:
        if self.batch_size is not None:
            picked = list(range(min(self.batch_size, len(self._waiting))))
        else:
            assert self.capacity is not None
            picked = select_row([self.length(s) for s, _ in self._waiting], self.capacity)
        chosen = set(picked)
        taken = [self._waiting[i] for i in picked]
        self._waiting = [item for i, item in enumerate(self._waiting) if i not in chosen]
        assert self._version is not None
        return ReadyPack(
            version=self._version,
            segments=[s for s, _ in taken],
            tokens=sum(self.length(s) for s, _ in taken),
            origins=[o for _, o in taken],
        )


class ReadyPackQueue(Generic[S]):
    """The per-rank FIFO of ready packs between the actor (producer) and the learner (consumer).

    Thread-safe. ``put`` drops the oldest pack (oldest weight version first) when the queue would hold
    more than ``limit`` packs, reserved and in-training ones counted (never dropped). ``reserve`` drops stale
    packs, then sets the oldest eligible ones aside for the coming step (``put`` never evicts them);
    ``take_reserved`` pops them for the step's passes, ``mark_trained`` counts them once their backward
    ran, and ``unreserve`` puts them back in front when the step ran Channel-A. A condition variable
    lets the actor wait until the learner consumed something (pacing) without polling.
    """

    def __init__(self, limit: int):
        if limit <= 0:
            raise ValueError(f"`{_LIMIT_KEY}` = {limit}: the queue must hold at least one pack")
        self.limit = limit
        self.counts = QueueCounts()
        self._packs: deque[ReadyPack[S]] = deque()
        self._reserved: list[ReadyPack[S]] = []
        self._training: deque[ReadyPack[S]] = deque()  # taken by a step, not yet through its backward
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)
        self.dropped_origins: list[
            SegmentOrigin
        ] = []  # records whose packs were dropped (resume bookkeeping)

    def __len__(self) -> int:
        """Packs held: queued, reserved, and taken but not yet trained."""
        with self._lock:
            return len(self._packs) + len(self._reserved) + len(self._training)

    @property
    def ready(self) -> int:
        """Packs waiting to be trained: queued or reserved (not those a step took and trains now)."""
        with self._lock:
            return len(self._packs) + len(self._reserved)

    def put(self, pack: ReadyPack[S]) -> None:
        with self._lock:
            pack.seq = self.counts.produced
            self.counts.add("produced", [pack])
            self._packs.append(pack)
            self._evict_over_limit_locked()
            self.changed.notify_all()

    @property
    def free(self) -> int:
        """How many more packs fit before ``put`` evicts one (queued, reserved and in-training count)."""
        with self._lock:
            return self.limit - self._depth_locked()

    def drop_stale(self, current_version: int, version_window: int) -> int:
        """Drop every pack too old to train under ``current_version``; returns how many."""
        with self._lock:
            return self._drop_stale_locked(current_version, version_window)

    def eligible(self, current_version: int, version_window: int) -> int:
        """How many held packs (queued or reserved) are fresh enough for ``current_version``."""
        with self._lock:
            held = [*self._reserved, *self._packs]
            return sum(is_eligible(p.version, current_version, version_window) for p in held)

    def reserve(self, count: int, current_version: int, version_window: int) -> int:
        """Drop stale packs, then set up to ``count`` oldest eligible ones aside for the coming step;
        returns how many are reserved."""
        with self._lock:
            self._drop_stale_locked(current_version, version_window)
            while len(self._reserved) < count and self._packs:
                self._reserved.append(self._packs.popleft())
            return len(self._reserved)

    def unreserve(self) -> None:
        """Put reserved packs back at the front, oldest first (their step ran Channel-A)."""
        with self._lock:
            self._packs.extendleft(reversed(self._reserved))
            self._reserved.clear()
            self._evict_over_limit_locked()  # the actor filled the queue meanwhile

    def take_reserved(self, count: int) -> list[ReadyPack[S]]:
        """Pop ``count`` reserved packs for the step whose vote counted them; they count as trained
        once :meth:`mark_trained` says their backward pass is done."""
        with self._lock:
            if len(self._reserved) < count:
                raise RuntimeError(
                    f"{len(self._reserved)} packs are reserved, the step takes {count}: reserve before the vote"
                )
            taken, self._reserved = self._reserved[:count], self._reserved[count:]
            self._training.extend(taken)
            self.changed.notify_all()
            return taken

    def mark_trained(self, count: int) -> None:
        """The oldest ``count`` taken packs went through their forward/backward."""
        with self._lock:
            done = [self._training.popleft() for _ in range(min(count, len(self._training)))]
            self.counts.add("trained", done)
            self.changed.notify_all()  # room in the queue for the actor

    def versions(self) -> list[int]:
        with self._lock:
            return [p.version for p in self._packs]

    def untaken_origins(self) -> list[SegmentOrigin]:
        """The records of the packs queued or reserved, not taken by a step."""
        with self._lock:
            return [o for pack in [*self._reserved, *self._packs] for o in pack.origins]

    def discard_all(self) -> int:
        """Shutdown: count every queued pack as discarded and empty the queue; returns how many."""
        with self._lock:
            left = [*self._packs, *self._reserved, *self._training]
            self.counts.add("discarded", left)
            count = len(left)
            self._packs.clear()
            self._reserved.clear()
            self._training.clear()
            self.changed.notify_all()
            return count

    def wait_for_change(self, timeout_s: float) -> None:
        """Block (at most ``timeout_s``) until a pack is put, taken or dropped, or :meth:`notify` is called."""
        with self._lock:
            self.changed.wait(timeout=timeout_s)

    def notify(self) -> None:
        """Wake every thread in :meth:`wait_for_change` (the version moved on, or shutdown)."""
        with self._lock:
            self.changed.notify_all()

    def take_dropped_origins(self) -> list[SegmentOrigin]:
        """Records of the packs dropped since the previous call (they count as consumed)."""
        with self._lock:
            origins, self.dropped_origins = self.dropped_origins, []
            return origins

    def _depth_locked(self) -> int:
        return len(self._packs) + len(self._reserved) + len(self._training)

    def _evict_over_limit_locked(self) -> None:
        """Hold at most ``limit`` packs, reserved and in-training ones included (those are never
        evicted): drop the queued pack of the oldest weight version, the earliest produced among those.
        A stale pack put into a full queue is thus dropped itself, not the oldest fresh one."""
        while self._depth_locked() > self.limit and self._packs:
            index = min(range(len(self._packs)), key=lambda i: (self._packs[i].version, self._packs[i].seq))
            oldest = self._packs[index]
            del self._packs[index]
            self.counts.add("dropped_oldest", [oldest])
            self.dropped_origins.extend(oldest.origins)

    def _drop_stale_locked(self, current_version: int, version_window: int) -> int:
        fresh = [p for p in self._packs if is_eligible(p.version, current_version, version_window)]
        stale = [p for p in self._packs if not is_eligible(p.version, current_version, version_window)]
        dropped = len(stale)
        if dropped:
            for pack in stale:
                self.dropped_origins.extend(pack.origins)
            self._packs = deque(fresh)
            self.counts.add("dropped_stale", stale)
            self.changed.notify_all()
        return dropped
