"""Move training state off the accelerator while a colocated rollout engine generates.

Owns: :func:`rollout_offload`, the context the trainer wraps around one rollout phase (lazy engine
start, weight sync and generation), and :class:`ColocatedBackend`, the protocol that marks a
backend whose engine shares the training devices. On entry the selected state (model parameters,
buffers and gradients; optimizer state such as Adam moments) is copied to host memory and the
device copies are dropped; on exit the engine is put to sleep (``vllm.sleep_level``), then the
state is copied back, bit-exact, before the next forward/backward. Leaves out: the engine's own
memory (``rollout.vllm_engine``) and when the trainer syncs (``training.variants``).

Parameters keep their identity (``param.data`` is swapped), so optimizers, schedulers and DDP
hooks stay valid. Gradients of a DDP-wrapped model stay on the device (DDP may keep them as views
of its buckets). DeepSpeed owns its partitions and optimizer buffers, so offloading under
DeepSpeed fails fast instead of corrupting them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from rollmatch.config.schema import ROLLOUT_KEY, OffloadConfig
from rollmatch.errors import ConfigError, ConfigProblem

OFFLOAD_KEY = f"{ROLLOUT_KEY}.offload"
MITIGATIONS = (
    f"set `{OFFLOAD_KEY}.enabled: false`, or `{ROLLOUT_KEY}.rollout_backend: hf`, "
    "or train without DeepSpeed ZeRO (DDP) / without its stage 3"
)


@runtime_checkable
class ColocatedBackend(Protocol):
    """A rollout backend whose engine runs on the training devices."""

    def release_device_memory(self) -> None:
        """Free the engine's device memory until its next use (vLLM sleep mode; may be a no-op)."""
        ...


@dataclass
class OffloadState:
    """What one rollout phase moved to host memory (for logging and checks)."""

    num_tensors: int = 0
    num_bytes: int = 0
    _restore: list[tuple[Any, Any, torch.device, torch.Tensor]] = field(default_factory=list, repr=False)


def rollout_offload(
    offload: OffloadConfig, *, model: nn.Module, optimizer: Any, backend: Any
) -> contextlib.AbstractContextManager[OffloadState]:
    """The context for one rollout phase: a no-op unless the backend is colocated.

    With ``offload.enabled`` the selected state is offloaded for the duration; with a colocated
    backend the engine is put to sleep on exit either way (``vllm.sleep_level`` 0: nothing happens).
    """
    if not isinstance(backend, ColocatedBackend):
        return contextlib.nullcontext(OffloadState())
    offload_model = offload.enabled and offload.offload_model
    offload_optimizer = offload.enabled and offload.offload_optimizer
    if offload_model or offload_optimizer:
        check_offload_is_safe(model=model, optimizer=optimizer)
    return _offloaded(model if offload_model else None, optimizer if offload_optimizer else None, backend)


def check_offload_is_safe(*, model: nn.Module, optimizer: Any) -> None:
    """Fail fast where offloading would corrupt state another library manages (DeepSpeed).

    DeepSpeed ZeRO keeps parameters as views of flat (stage 3: partitioned) buffers and owns the
    optimizer's buffers; swapping their storage would silently detach them. The config's side
    (``training.deepspeed`` set) is a rule, checked once when the run is resolved
    (``config.rollout_rules.rule_offload``); this checks the objects themselves.
    """
    if _is_deepspeed(model, optimizer):
        raise ConfigError(
            [
                ConfigProblem(
                    f"{OFFLOAD_KEY}.enabled",
                    True,
                    f"the model or optimizer is managed by DeepSpeed ZeRO, which rollout offload cannot move "
                    f"safely: {MITIGATIONS}",
                )
            ]
        )


@contextlib.contextmanager
def _offloaded(model: nn.Module | None, optimizer: Any, backend: ColocatedBackend) -> Iterator[OffloadState]:
    state = OffloadState()
    try:
        if optimizer is not None:
            _offload_optimizer(_unwrap_optimizer(optimizer), state)
        if model is not None:
            _offload_model(model, state)
        yield state
    finally:
        try:
            backend.release_device_memory()  # free the engine's memory before training state returns
        finally:
            _restore(state)


def _offload_model(model: nn.Module, state: OffloadState) -> None:
    keep_grads = isinstance(model, nn.parallel.DistributedDataParallel)
    seen: set[int] = set()
    for tensor_owner in [*model.parameters(), *model.buffers()]:
        if id(tensor_owner) in seen:
            continue
        seen.add(id(tensor_owner))
        _move_data(tensor_owner, state)
        if isinstance(tensor_owner, nn.Parameter) and tensor_owner.grad is not None and not keep_grads:
            _move_attribute(tensor_owner, "grad", state)


def _offload_optimizer(optimizer: torch.optim.Optimizer, state: OffloadState) -> None:
    for param_state in optimizer.state.values():
        for key, value in list(param_state.items()):
            if isinstance(value, torch.Tensor):
                host = _host_copy(value)
                state._restore.append((param_state, key, value.device, host))
                param_state[key] = host
                _count(state, value)


def _move_data(tensor: torch.Tensor, state: OffloadState) -> None:
    host = _host_copy(tensor.data)
    state._restore.append((tensor, ".data", tensor.device, host))
    _count(state, tensor)
    tensor.data = host


def _move_attribute(owner: Any, name: str, state: OffloadState) -> None:
    value = getattr(owner, name)
    host = _host_copy(value)
    state._restore.append((owner, name, value.device, host))
    _count(state, value)
    setattr(owner, name, host)


def _restore(state: OffloadState) -> None:
    # In offload order: a parameter's data returns before its gradient (torch requires both on
    # the same device when ``.grad`` is assigned).
    for owner, key, device, host in state._restore:
        # Always a fresh copy, also on CPU, so the state never aliases the offload buffers.
        value = host.to(device, copy=True)
        if key == ".data":
            owner.data = value
        elif isinstance(owner, dict):
            owner[key] = value
        else:
            setattr(owner, key, value)
    state._restore.clear()


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host-memory copy (pinned when a GPU is present, for fast copies back)."""
    pin = tensor.device.type == "cuda"
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
    return host.copy_(tensor.detach())


def _count(state: OffloadState, tensor: torch.Tensor) -> None:
    state.num_tensors += 1
    state.num_bytes += tensor.numel() * tensor.element_size()


def _unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer  # accelerate's AcceleratedOptimizer and similar wrappers
    return optimizer


def _is_deepspeed(model: nn.Module, optimizer: Any) -> bool:
    if type(model).__name__ == "DeepSpeedEngine" or type(optimizer).__module__.startswith("deepspeed"):
        return True
    first = next(iter(model.parameters()), None)
    return first is not None and hasattr(first, "ds_id")


class OffloadedRolloutBackend:
    """A rollout backend whose every rollout phase (lazy engine start, weight sync, generation)
    runs inside :func:`rollout_offload`; the trainer uses it in place of the colocated backend.

    The optimizer is looked up at call time: HF's Trainer creates it after the backend is built.
    """

    def __init__(self, backend: Any, offload: OffloadConfig, *, model: nn.Module, optimizer_getter: Any):
        self.inner = backend
        self.name = backend.name
        self._offload = offload
        self._model = model
        self._optimizer_getter = optimizer_getter

    def _phase(self) -> contextlib.AbstractContextManager[OffloadState]:
        return rollout_offload(
            self._offload, model=self._model, optimizer=self._optimizer_getter(), backend=self.inner
        )

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    def generate(self, requests: Any, decoding: Any, seed: int) -> Any:
        with self._phase():
            return self.inner.generate(requests, decoding, seed)

    def sync_weights(self, model: Any, version: int) -> Any:
        with self._phase():
            return self.inner.sync_weights(model, version)

    def close(self) -> None:
        self.inner.close()


def with_rollout_offload(
    backend: Any, offload: OffloadConfig, *, model: nn.Module, optimizer_getter: Any
) -> Any:
    """Wrap colocated backends so each rollout phase offloads/sleeps; others are returned as is."""
    if not isinstance(backend, ColocatedBackend):
        return backend
    return OffloadedRolloutBackend(backend, offload, model=model, optimizer_getter=optimizer_getter)
