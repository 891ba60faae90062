"""Collectives with timeouts: one object passed to whoever needs to talk across ranks.

Owns: the :class:`Collectives` protocol, a single-process :class:`LocalCollectives`, and
:class:`TorchCollectives` over ``torch.distributed`` (a gloo group for objects and scalars, so
CPU and GPU learners behave the same). Every wait has a timeout and its error names the phase.
Leaves out: process-group creation for weight sync (``rollmatch.sync.transport``).

A rank whose peer hangs must not hang too. :func:`init_default_group` creates the default group
with ``timeout_s`` before anything else can (the HF Trainer's own initialisation ignores its
``ddp_timeout`` on CPU, so a gradient all-reduce would wait 30 minutes), and a fatal distributed
error (a collective timeout, a lost peer) arms :func:`exit_hard_after`: the error is logged and
flushed, normal unwinding gets ``FATAL_EXIT_GRACE_S``, then the process leaves with
``os._exit(FATAL_EXIT_CODE)``. Process-group teardown after such an error can block forever;
the hard exit lets torchrun see a failed worker and tear the whole job down.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.distributed as torch_dist

from rollmatch.errors import CollectiveTimeoutError

log = logging.getLogger(__name__)
FATAL_EXIT_GRACE_S = 10.0
FATAL_EXIT_CODE = 3
# Messages of RuntimeErrors that gloo / NCCL raise for timeouts and lost peers.
_FATAL_MARKERS = (
    "gloo",
    "nccl",
    "timed out",
    "application timeout caused pair closure",  # gloo's wording of the same timeout, seen under CPU load
    "connection closed by peer",
    "connection reset",
    "processgroup",
)


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
            error = CollectiveTimeoutError(
                f"collective '{phase}' failed or timed out after {self.timeout.total_seconds():.0f}s on "
                f"rank {self.rank}/{self.world_size}: {exc}"
            )
            exit_hard_after(FATAL_EXIT_GRACE_S, str(error))
            raise error from exc
        if ok is False:
            error = CollectiveTimeoutError(
                f"collective '{phase}' timed out after {self.timeout.total_seconds():.0f}s on rank {self.rank}"
            )
            exit_hard_after(FATAL_EXIT_GRACE_S, str(error))
            raise error

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


# ------------------------------------------------------------------------------- fatal errors
def init_default_group(timeout_s: float) -> None:
    """Under torchrun, create the default group with ``timeout_s`` (gloo on CPU, NCCL on GPU).

    A no-op in a single process or when a group exists already. Must run before the HF Trainer's
    arguments are built, which would otherwise create the group with a 30-minute timeout.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not torch_dist.is_available():
        return
    if torch_dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch_dist.init_process_group(backend=backend, timeout=_dt.timedelta(seconds=timeout_s))


def is_fatal_distributed_error(exc: BaseException) -> bool:
    """A collective timeout or a lost peer, anywhere in ``exc``'s cause / context chain."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, CollectiveTimeoutError | torch_dist.DistError):
            return True
        if isinstance(current, RuntimeError) and any(m in str(current).lower() for m in _FATAL_MARKERS):
            return True
        current = current.__cause__ or current.__context__
    return False


_armed = threading.Event()


def exit_hard_after(grace_s: float, why: str) -> None:
    """Log and flush ``why`` now; ``os._exit(FATAL_EXIT_CODE)`` in ``grace_s`` unless the process
    has left by then (armed once per process)."""
    if _armed.is_set():
        return
    _armed.set()
    rank = os.environ.get("RANK", "0")
    log.error("rank %s: fatal distributed error, leaving in %.0fs: %s", rank, grace_s, why)
    _flush()

    def leave() -> None:
        log.error("rank %s: still running %.0fs after a fatal distributed error; exiting now", rank, grace_s)
        _flush()
        os._exit(FATAL_EXIT_CODE)

    timer = threading.Timer(grace_s, leave)
    timer.daemon = True
    timer.start()


@contextmanager
def exit_hard_on_fatal_distributed_error(grace_s: float = FATAL_EXIT_GRACE_S) -> Iterator[None]:
    """Around a multi-rank entry point: a fatal distributed error arms :func:`exit_hard_after`, then
    propagates as usual (its message is printed; the hard exit only bounds the teardown)."""
    try:
        yield
    except BaseException as exc:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and is_fatal_distributed_error(exc):
            exit_hard_after(grace_s, f"{type(exc).__name__}: {exc}")
        raise


def _flush() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
