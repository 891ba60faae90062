"""Several learner ranks in one process, one thread each: the collectives of a real gather (each rank
waits for the others at every call), for planner tests that need every rank's view of a step."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from rollmatch.collectives import LocalCollectives

T = TypeVar("T")
_WAIT_S = 60.0  # a rank waits at most this long for the others at a collective


class ThreadRanks(LocalCollectives):
    """Rank ``rank`` of ``world_size`` thread ranks sharing one board; gathers and broadcasts block until
    every rank arrived (bounded), as torch.distributed's do."""

    def __init__(self, rank: int, world_size: int, board: dict[int, Any], barrier: threading.Barrier):
        super().__init__()
        self.rank, self.world_size, self.board, self._barrier = rank, world_size, board, barrier

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_gather_object(self, value: Any, phase: str) -> list[Any]:
        self.board[self.rank] = value
        self._barrier.wait(timeout=_WAIT_S)
        values = [self.board[rank] for rank in range(self.world_size)]
        self._barrier.wait(timeout=_WAIT_S)
        return values

    def broadcast_object(self, obj: Any, phase: str, src: int = 0) -> Any:
        return self.all_gather_object(obj, phase)[src]

    def barrier(self, phase: str) -> None:
        self.all_gather_object(None, phase)


def on_ranks(world_size: int, run: Callable[[ThreadRanks], T]) -> list[T]:
    """``run(collectives)`` on every rank at once; each rank's result, in rank order."""
    board: dict[int, Any] = {}
    barrier = threading.Barrier(world_size)
    with concurrent.futures.ThreadPoolExecutor(world_size) as pool:
        futures = [
            pool.submit(run, ThreadRanks(rank, world_size, board, barrier)) for rank in range(world_size)
        ]
        return [future.result(timeout=4 * _WAIT_S) for future in futures]
