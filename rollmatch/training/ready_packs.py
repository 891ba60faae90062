"""Ready packs of the async actor-learner: typed queue items, version-pure packing, the bounded queue.

Owns (pure, thread-safe where it says so, no torch.distributed, no HTTP):

- :class:`ReadyPack`: one packed micro-batch (one forward/backward) tagged with the weight version
  its rollouts were generated under (as the rollout server reported it);
- :class:`VersionPurePacker`: turns a stream of version-tagged segments into packs that never mix two
  versions — when a newer version arrives, segments of older versions are flushed into their own packs;
- :class:`ReadyPackQueue`: the per-rank FIFO between the actor thread and the learner: bounded by
  ``queue_limit`` (drop-oldest), stale packs (``ver < current - version_window``) dropped at
  consumption, and counters that account for every pack produced.

Leaves out: where segments come from (``training.actor``) and the step decisions
(``training.step`` / ``training.async_mode``).

Accounting invariant (checked by tests and logged at shutdown):
``produced == trained + dropped_stale + dropped_oldest + discarded + len(queue)``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from rollmatch.packing.binpack import select_row

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
    """Cumulative counters of one rank's queue (every pack produced ends in exactly one of them)."""

    produced: int = 0
    trained: int = 0
    dropped_stale: int = 0
    dropped_oldest: int = 0
    discarded: int = 0  # still queued when the actor-learner shut down

    def balance(self, depth: int) -> int:
        """``produced - (trained + dropped + discarded + depth)``: 0 when every pack is accounted for."""
        return self.produced - (
            self.trained + self.dropped_stale + self.dropped_oldest + self.discarded + depth
        )


def is_eligible(pack_version: int, current_version: int, version_window: int) -> bool:
    """The freshness rule: a pack is trainable iff ``pack_version >= current_version - version_window``."""
    return pack_version >= current_version - version_window


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

    Thread-safe. ``put`` drops the oldest pack when ``limit`` packs are queued; ``take_eligible``
    first drops stale packs, then pops the oldest eligible ones. A condition variable lets the actor
    wait until the learner consumed something (pacing) without polling.
    """

    def __init__(self, limit: int):
        if limit <= 0:
            raise ValueError(f"`{_LIMIT_KEY}` = {limit}: the queue must hold at least one pack")
        self.limit = limit
        self.counts = QueueCounts()
        self._packs: deque[ReadyPack[S]] = deque()
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)
        self.dropped_origins: list[
            SegmentOrigin
        ] = []  # records whose packs were dropped (resume bookkeeping)

    def __len__(self) -> int:
        with self._lock:
            return len(self._packs)

    def put(self, pack: ReadyPack[S]) -> None:
        with self._lock:
            pack.seq = self.counts.produced
            self.counts.produced += 1
            self._packs.append(pack)
            while len(self._packs) > self.limit:
                oldest = self._packs.popleft()
                self.counts.dropped_oldest += 1
                self.dropped_origins.extend(oldest.origins)
            self.changed.notify_all()

    def drop_stale(self, current_version: int, version_window: int) -> int:
        """Drop every pack too old to train under ``current_version``; returns how many."""
        with self._lock:
            return self._drop_stale_locked(current_version, version_window)

    def eligible(self, current_version: int, version_window: int) -> int:
        """How many queued packs are fresh enough for ``current_version``."""
        with self._lock:
            return sum(is_eligible(p.version, current_version, version_window) for p in self._packs)

    def take_eligible(self, count: int, current_version: int, version_window: int) -> list[ReadyPack[S]]:
        """Drop stale packs, then pop the ``count`` oldest eligible ones (raises if fewer are queued)."""
        with self._lock:
            self._drop_stale_locked(current_version, version_window)
            if len(self._packs) < count:
                raise RuntimeError(
                    f"ready-pack queue holds {len(self._packs)} eligible packs, {count} were promised by the "
                    "step's feasibility check (only the learner thread may consume)"
                )
            taken = [self._packs.popleft() for _ in range(count)]
            self.counts.trained += count
            self.changed.notify_all()
            return taken

    def versions(self) -> list[int]:
        with self._lock:
            return [p.version for p in self._packs]

    def discard_all(self) -> int:
        """Shutdown: count every queued pack as discarded and empty the queue; returns how many."""
        with self._lock:
            count = len(self._packs)
            self.counts.discarded += count
            self._packs.clear()
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

    def _drop_stale_locked(self, current_version: int, version_window: int) -> int:
        fresh = [p for p in self._packs if is_eligible(p.version, current_version, version_window)]
        dropped = len(self._packs) - len(fresh)
        if dropped:
            for pack in self._packs:
                if not is_eligible(pack.version, current_version, version_window):
                    self.dropped_origins.extend(pack.origins)
            self._packs = deque(fresh)
            self.counts.dropped_stale += dropped
            self.changed.notify_all()
        return dropped
