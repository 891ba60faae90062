"""Collectives with timeouts: one object passed to whoever needs to talk across ranks.

Owns: the :class:`Collectives` protocol, a single-process :class:`LocalCollectives`, and
:class:`TorchCollectives` over ``torch.distributed`` (a gloo group for objects and scalars, so
CPU and GPU learners behave the same). Every wait has a timeout and its error names the phase.
Leaves out: process-group creation for weight sync (``rollmatch.sync.transport``).
"""

from __future__ import annotations

import datetime as _dt
from typing import Any, Protocol

import torch
import torch.distributed as torch_dist

from rollmatch.errors import CollectiveTimeoutError


class Collectives(Protocol):
    """Rank-aware collectives; every call names the phase for its timeout error."""

    rank: int
    world_size: int

    @property
    def is_main(self) -> bool: ...

    def barrier(self, phase: str) -> None: ...

    def broadcast_object(self, obj: Any, phase: str, src: int = 0) -> Any: ...

    def all_reduce_sum(self, values: list[float], phase: str) -> list[float]: ...

    def all_reduce_min(self, values: list[float], phase: str) -> list[float]: ...

    def all_gather_object(self, obj: Any, phase: str) -> list[Any]: ...


class LocalCollectives:
    """The single-process stand-in: every collective is the identity."""

    rank = 0
    world_size = 1

    @property
    def is_main(self) -> bool:
        return True

    def barrier(self, phase: str) -> None:
        return None

    def broadcast_object(self, obj: Any, phase: str, src: int = 0) -> Any:
        return obj

    def all_reduce_sum(self, values: list[float], phase: str) -> list[float]:
        return [float(v) for v in values]

    def all_reduce_min(self, values: list[float], phase: str) -> list[float]:
        return [float(v) for v in values]

    def all_gather_object(self, obj: Any, phase: str) -> list[Any]:
        return [obj]


class TorchCollectives:
    """Collectives over an initialised ``torch.distributed`` default group.

    Scalars and objects travel on a dedicated gloo group (also under NCCL learners), so waits can
    be bounded with ``Work.wait(timeout)`` and no device tensors are needed.
    """

    def __init__(self, timeout_s: float = 600.0):
        if not torch_dist.is_available() or not torch_dist.is_initialized():
            raise RuntimeError("TorchCollectives needs torch.distributed initialised (run under torchrun)")
        self.rank = torch_dist.get_rank()
        self.world_size = torch_dist.get_world_size()
        self.timeout = _dt.timedelta(seconds=timeout_s)
        if torch_dist.get_backend() == "gloo":
            self._group = torch_dist.group.WORLD
        else:
            self._group = torch_dist.new_group(backend="gloo", timeout=self.timeout)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _wait(self, work: Any, phase: str) -> None:
        try:
            ok = work.wait(timeout=self.timeout)
        except RuntimeError as exc:  # gloo raises on timeout / peer failure
            raise CollectiveTimeoutError(
                f"collective '{phase}' failed or timed out after {self.timeout.total_seconds():.0f}s on "
                f"rank {self.rank}/{self.world_size}: {exc}"
            ) from exc
        if ok is False:
            raise CollectiveTimeoutError(
                f"collective '{phase}' timed out after {self.timeout.total_seconds():.0f}s on rank {self.rank}"
            )

    def barrier(self, phase: str) -> None:
        self.all_reduce_sum([0.0], phase)

    def _all_reduce(self, values: list[float], op: Any, phase: str) -> list[float]:
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
        self._wait(torch_dist.all_reduce(tensor, op=op, group=self._group, async_op=True), phase)
        return tensor.tolist()

    def all_reduce_sum(self, values: list[float], phase: str) -> list[float]:
        return self._all_reduce(values, torch_dist.ReduceOp.SUM, phase)

    def all_reduce_min(self, values: list[float], phase: str) -> list[float]:
        return self._all_reduce(values, torch_dist.ReduceOp.MIN, phase)

    def broadcast_object(self, obj: Any, phase: str, src: int = 0) -> Any:
        gathered = self.all_gather_object(obj if self.rank == src else None, phase)
        return gathered[src]

    def all_gather_object(self, obj: Any, phase: str) -> list[Any]:
        # Objects are pickled into byte tensors so the wait stays bounded (the *_object helpers of
        # torch.distributed block without a timeout).
        import pickle

        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = self._all_gather_tensor(torch.tensor([payload.numel()], dtype=torch.int64), phase)
        max_size = int(max(int(s.item()) for s in sizes))
        padded = torch.zeros(max_size, dtype=torch.uint8)
        padded[: payload.numel()] = payload
        chunks = self._all_gather_tensor(padded, phase)
        return [
            pickle.loads(c[: int(s.item())].numpy().tobytes()) for c, s in zip(chunks, sizes, strict=True)
        ]

    def _all_gather_tensor(self, tensor: torch.Tensor, phase: str) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._wait(torch_dist.all_gather(out, tensor, group=self._group, async_op=True), phase)
        return out


def build_collectives(timeout_s: float = 600.0) -> Collectives:
    """Torch collectives when launched by torchrun with an initialised group, else the local stand-in."""
    if torch_dist.is_available() and torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
        return TorchCollectives(timeout_s=timeout_s)
    return LocalCollectives()
