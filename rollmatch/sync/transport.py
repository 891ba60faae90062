"""Weight transport: a private broadcast group between a trainer and a rollout server's workers.

Owns: the :class:`WeightTransport` protocol, :class:`GroupTransport` (a stateless process group on
its own ``TCPStore``: gloo for CPU tensors, NCCL for CUDA tensors, beside any default group) and
:class:`LocalTransport` (the same interface inside one process, for tests and debugging).
Rank convention (ms-swift / TRL): the server's workers are ranks ``0..W-1`` and host the store on
``group_port``; the trainer's rank 0 joins as the last rank ``W`` and is the broadcast source.
Leaves out: what is sent and how an update is acknowledged (``rollmatch.sync.transaction``).

Every wait is bounded: store and group creation, and each broadcast, raise
:class:`~rollmatch.errors.CollectiveTimeoutError` naming the phase and the group address.
Network exposure: rank 0 listens on exactly the interface it is given, resolved and refused when it
is an all-interfaces address however spelled (:func:`bind_listener`; a ``TCPStore`` left to itself
listens on all interfaces), every rank's gloo sockets bind to that address or the interface that
reaches the group's host, and a waiting rank 0 can be cancelled (``cancel``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import ipaddress
import os
import queue
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.distributed as torch_dist

from rollmatch.errors import CollectiveTimeoutError

GroupBackend = Literal["gloo", "nccl"]


class PendingTransfer(Protocol):
    """A posted broadcast; ``wait`` blocks until it completed (or raises naming ``phase``)."""

    def wait(self, phase: str) -> None: ...


class WeightTransport(Protocol):
    """A broadcast-only group; ``rank``/``world_size`` follow the rank convention above."""

    rank: int
    world_size: int

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> PendingTransfer:
        """Post a broadcast of ``tensor`` from ``src`` (in place on receivers); returns at once."""
        ...

    def broadcast(self, tensor: torch.Tensor, src: int, phase: str) -> None:
        """Broadcast and wait (bounded by the transport's timeout)."""
        ...

    def close(self, *, abort: bool = False) -> None:
        """Tear the group down; safe to call twice (``abort``: a transfer failed, do not wait for peers)."""
        ...


def default_backend(device: torch.device | str) -> GroupBackend:
    """gloo for CPU tensors, NCCL for CUDA tensors."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


# -------------------------------------------------------------------------------------- real group
@dataclass
class _TorchPending:
    work: torch_dist.Work
    timeout: _dt.timedelta
    where: str

    def wait(self, phase: str) -> None:
        try:
            ok = self.work.wait(timeout=self.timeout)
        except RuntimeError as exc:  # gloo raises on timeout and on a dead peer
            raise CollectiveTimeoutError(
                f"weight sync '{phase}' failed or timed out after {self.timeout.total_seconds():.0f}s on "
                f"{self.where}: {exc}"
            ) from exc
        if ok is False:
            raise CollectiveTimeoutError(
                f"weight sync '{phase}' timed out after {self.timeout.total_seconds():.0f}s on {self.where}"
            )


class GroupTransport:
    """A process group of ``world_size`` ranks on its own ``TCPStore`` at ``host:port``.

    Rank 0 hosts the store, listening on ``host`` only (or on ``listener``, a socket already bound
    there by :func:`bind_listener`), and waits for the other ranks at most ``timeout_s``, or until
    ``cancel`` is set. The other ranks connect to ``host:port``.
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: GroupBackend = "gloo",
        timeout_s: float = 240.0,
        device: torch.device | str = "cpu",
        listener: socket.socket | None = None,
        cancel: threading.Event | None = None,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device(device)
        self.timeout = _dt.timedelta(seconds=timeout_s)
        self.where = f"weight-sync group {host}:{port} ({backend}, rank {rank}/{world_size})"
        self._group: torch_dist.ProcessGroup | None = None
        try:
            if rank == 0:
                listener = listener if listener is not None else bind_listener(host, port)
                interface = str(listener.getsockname()[0])  # gloo binds the address checked, not a new lookup
                self._store = torch_dist.TCPStore(
                    host,
                    port,
                    world_size,
                    is_master=True,
                    timeout=self.timeout,
                    wait_for_workers=False,
                    master_listen_fd=listener.detach(),  # the store owns (and closes) the socket now
                )
                _wait_for_peers(self._store, world_size, timeout_s, cancel, self.where)
            else:
                self._store = torch_dist.TCPStore(
                    host, port, world_size, is_master=False, timeout=self.timeout
                )
                self._store.add(_JOINED_KEY, 1)
                interface = local_interface_towards(host, port)
            self._group = _make_group(
                self._store, rank, world_size, backend, self.timeout, self.device, interface
            )
        except (RuntimeError, OSError, torch_dist.DistError) as exc:
            self._store = None
            raise CollectiveTimeoutError(
                f"could not form the {self.where} within {timeout_s:.0f}s: {exc}. Check that the port is "
                "free on the server host and reachable from the trainer (group_port of the server entry)."
            ) from exc

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> PendingTransfer:
        if self._group is None:
            raise CollectiveTimeoutError(f"{self.where} is closed")
        opts = torch_dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = self.timeout
        return _TorchPending(self._group.broadcast([tensor], opts), self.timeout, self.where)

    def broadcast(self, tensor: torch.Tensor, src: int, phase: str) -> None:
        self.broadcast_async(tensor, src).wait(phase)

    def close(self, *, abort: bool = False) -> None:
        """Release the group. ``abort``: a transfer on it failed (a peer may be dead): NCCL's ``abort()``
        returns at once, where ``shutdown()`` would wait for the dead peer's pending work."""
        group = getattr(self, "_group", None)
        if group is not None:
            self._group = None
            # NCCL groups must be shut down explicitly; gloo's sockets close when released.
            if self.backend == "nccl":
                if abort:
                    group.abort()
                else:
                    group.shutdown()
        self._store = None


_JOINED_KEY = "rollmatch/joined"
_JOIN_POLL_S = 0.05


class GroupCancelled(CollectiveTimeoutError):
    """Rank 0 stopped waiting for its peers because the group was cancelled."""


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` only (rank 0's store); ``OSError`` names the address.

    ``host`` is resolved first and the *address* is checked, not its spelling: ``0``, ``0x0``,
    ``000.000.000.000``, ``::0`` or ``::ffff:0.0.0.0`` all mean every interface and are refused like
    ``0.0.0.0`` and ``::``. The socket binds the address that was checked (no second lookup)."""
    family, address = _listen_address(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(64)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} for the weight-sync group: {exc}") from exc
    return sock


def local_interface_towards(host: str, port: int) -> str:
    """The local address this machine uses to reach ``host`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return str(probe.getsockname()[0])


def _listen_address(host: str, port: int) -> tuple[socket.AddressFamily, tuple[Any, ...]]:
    """The family and socket address ``host`` resolves to (IPv6 when it holds a ``:``, else IPv4);
    ``OSError`` when it does not resolve or is an unspecified (all-interfaces) address."""
    if host:
        try:
            infos = socket.getaddrinfo(
                host, port, socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM
            )
        except (OSError, UnicodeError, ValueError) as exc:  # unknown, IDNA-invalid or NUL-bearing name
            raise OSError(f"cannot resolve {host!r} to listen on for the weight-sync group: {exc}") from exc
        family, _, _, _, address = infos[0]  # getaddrinfo raises rather than return nothing
        if not _is_unspecified(str(address[0])):
            return family, address
        shown = f"{host!r}" if host == address[0] else f"{host!r} is {address[0]}"
    else:
        shown = "''"  # what ``socket.bind`` makes of an empty host
    raise OSError(
        f"refusing to listen on all interfaces ({shown}) for a weight-sync group: name the interface "
        "the trainer reaches the server at (loopback when both run on one host)"
    )


def _is_unspecified(address: str) -> bool:
    """``0.0.0.0``, ``::`` or the IPv4-mapped ``::ffff:0.0.0.0``, however the address was spelled."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return ip.is_unspecified or (mapped is not None and mapped.is_unspecified)


def _wait_for_peers(
    store: torch_dist.TCPStore, world_size: int, timeout_s: float, cancel: threading.Event | None, where: str
) -> None:
    deadline = time.monotonic() + timeout_s
    while int(store.add(_JOINED_KEY, 0)) < world_size - 1:
        if cancel is not None and cancel.is_set():
            raise GroupCancelled(f"{where}: cancelled while waiting for the trainer to join")
        if time.monotonic() >= deadline:
            raise CollectiveTimeoutError(f"{where}: the trainer did not join within {timeout_s:.0f}s")
        time.sleep(_JOIN_POLL_S)


NCCL_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_ERRORS_RAISE = "2"  # CleanUpOnly: abort the communicator and raise in the waiting call


@contextlib.contextmanager
def nccl_errors_raise() -> Iterator[None]:
    """While a weight-sync NCCL group is constructed (the variable is read then, per group):
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``, so a dead or hung server makes the pushing rank's wait raise
    (and the push fail over) instead of PyTorch's default, which tears the whole learner process down.
    The learner's own default group keeps whatever the environment says (a dead learner rank must still
    end the run)."""
    before = os.environ.get(NCCL_ERROR_HANDLING_ENV)
    os.environ[NCCL_ERROR_HANDLING_ENV] = NCCL_ERRORS_RAISE
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(NCCL_ERROR_HANDLING_ENV, None)
        else:
            os.environ[NCCL_ERROR_HANDLING_ENV] = before


def _make_group(
    store: torch_dist.Store,
    rank: int,
    world_size: int,
    backend: GroupBackend,
    timeout: _dt.timedelta,
    device: torch.device,
    interface: str,
) -> torch_dist.ProcessGroup:
    if backend == "gloo":
        options = torch_dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [torch_dist.ProcessGroupGloo.create_device(hostname=interface)]
        return torch_dist.ProcessGroupGloo(store, rank, world_size, options)
    if not torch.cuda.is_available():
        raise RuntimeError("the NCCL weight-sync group needs CUDA; use gloo on CPU-only machines")
    options = torch_dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    with nccl_errors_raise():
        group = torch_dist.ProcessGroupNCCL(store, rank, world_size, options)
    # NCCL connects lazily; a first tiny broadcast makes construction the bounded rendezvous.
    probe = torch.zeros(1, device=device)
    opts = torch_dist.BroadcastOptions()
    opts.rootRank = world_size - 1
    opts.timeout = timeout
    if not group.broadcast([probe], opts).wait(timeout=timeout):
        raise RuntimeError("NCCL rendezvous broadcast did not complete")
    return group


# ----------------------------------------------------------------------------------- in process
class _LocalHub:
    """The shared state of one in-process group: a queue of posted payloads per rank."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.inboxes: list[queue.Queue[torch.Tensor]] = [queue.Queue() for _ in range(world_size)]
        self.lock = threading.Lock()


@dataclass
class _LocalPending:
    inbox: queue.Queue[torch.Tensor] | None
    target: torch.Tensor
    timeout_s: float
    where: str

    def wait(self, phase: str) -> None:
        if self.inbox is None:  # the source's own transfer completes when posted
            return
        try:
            payload = self.inbox.get(timeout=self.timeout_s)
        except queue.Empty:
            raise CollectiveTimeoutError(
                f"weight sync '{phase}' timed out after {self.timeout_s:.0f}s on {self.where}"
            ) from None
        if payload.shape != self.target.shape or payload.dtype != self.target.dtype:
            raise CollectiveTimeoutError(
                f"weight sync '{phase}' on {self.where}: sender posted {payload.dtype}{tuple(payload.shape)}, "
                f"receiver expected {self.target.dtype}{tuple(self.target.shape)}"
            )
        self.target.copy_(payload)


class LocalTransport:
    """One rank of an in-process group (threads play the ranks); same semantics as the real group."""

    def __init__(self, hub: _LocalHub, rank: int, timeout_s: float = 30.0):
        self._hub, self.rank, self.world_size = hub, rank, hub.world_size
        self.timeout_s = timeout_s
        self.where = f"in-process weight-sync group (rank {rank}/{hub.world_size})"

    @classmethod
    def group(cls, world_size: int, timeout_s: float = 30.0) -> list[LocalTransport]:
        """All ranks of a fresh in-process group."""
        hub = _LocalHub(world_size)
        return [cls(hub, rank, timeout_s) for rank in range(world_size)]

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> PendingTransfer:
        if self.rank == src:
            with self._hub.lock:
                for rank, inbox in enumerate(self._hub.inboxes):
                    if rank != src:
                        inbox.put(tensor.detach().clone())
            return _LocalPending(None, tensor, self.timeout_s, self.where)
        return _LocalPending(self._hub.inboxes[self.rank], tensor, self.timeout_s, self.where)

    def broadcast(self, tensor: torch.Tensor, src: int, phase: str) -> None:
        self.broadcast_async(tensor, src).wait(phase)

    def close(self, *, abort: bool = False) -> None:
        return None
