"""Rollout offload: training state leaves the device around a colocated rollout phase and returns exactly.

The engine here is a recording stand-in for a colocated backend (the real vLLM backend inside this
context is exercised in tests/rollout/test_vllm_colocate.py); it notes, at every call, whether the
training state was offloaded at that moment.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rollmatch.config.resolved import resolve_run
from rollmatch.config.schema import OffloadConfig, RollmatchConfig
from rollmatch.errors import ConfigError
from rollmatch.rollout.hf import HFBackend
from rollmatch.training.offload import ColocatedBackend, rollout_offload


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 6)).square().mean().backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model(torch.randn(4, 6)).square().mean().backward()  # mid-accumulation: gradients are live
    return model, optimizer


def _cfg(*, enabled: bool = True, model: bool = True, optimizer: bool = True) -> OffloadConfig:
    return OffloadConfig(enabled=enabled, offload_model=model, offload_optimizer=optimizer)


def _tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"param/{n}": p for n, p in model.named_parameters()}
    out |= {f"grad/{n}": p.grad for n, p in model.named_parameters()}
    out |= {f"buffer/{n}": b for n, b in model.named_buffers()}
    for i, state in enumerate(optimizer.state.values()):
        out |= {f"optim/{i}/{k}": v for k, v in state.items()}
    return out


class RecordingBackend:
    """A colocated backend stand-in: at every call, records which training tensors have left the
    storage they had when the rollout phase began (``begin``)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self.events: list[tuple[str, bool, bool]] = []
        self.pointers_at: dict[str, dict[str, int]] = {}
        self.begin()

    def begin(self) -> None:
        self.storage = self._pointers()

    def _pointers(self) -> dict[str, int]:
        return {k: t.data_ptr() for k, t in _tensors(self.model, self.optimizer).items()}

    def _record(self, event: str) -> None:
        self.pointers_at[event] = self._pointers()
        moved = {k for k, ptr in self.pointers_at[event].items() if ptr != self.storage[k]}
        model_off = all(k in moved for k in self.storage if not k.startswith("optim/"))
        optim_off = all(k in moved for k in self.storage if k.startswith("optim/"))
        assert not moved or model_off or optim_off, "a selected state moves as a whole"
        self.events.append((event, model_off, optim_off))

    def start_engine(self) -> None:
        self._record("init")

    def sync_weights(self, model: nn.Module, version: int) -> None:
        self._record("sync")

    def generate(self) -> None:
        self._record("generate")

    def release_device_memory(self) -> None:
        self._record("sleep")


def test_state_is_offloaded_for_init_sync_and_generation_and_restored_exactly() -> None:
    model, optimizer = _model_and_optimizer()
    before = {k: t.clone() for k, t in _tensors(model, optimizer).items()}
    backend = RecordingBackend(model, optimizer)
    assert isinstance(backend, ColocatedBackend)
    with rollout_offload(_cfg(), model=model, optimizer=optimizer, backend=backend) as state:
        backend.start_engine()
        backend.sync_weights(model, 1)
        backend.generate()
        offloaded = backend._pointers()
    restored = backend._pointers()
    assert all(restored[k] != offloaded[k] for k in restored)  # copied back, not aliasing host buffers
    assert backend.events == [
        ("init", True, True),
        ("sync", True, True),
        ("generate", True, True),
        ("sleep", True, True),
    ]
    assert backend.pointers_at["sleep"] == offloaded  # the engine sleeps before training state returns
    expected_bytes = sum(t.numel() * t.element_size() for t in before.values())
    assert (state.num_tensors, state.num_bytes) == (len(before), expected_bytes)
    after = _tensors(model, optimizer)
    assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype for k, v in before.items())
    model(torch.randn(4, 6)).square().mean().backward()  # parameters are still the optimizer's parameters
    optimizer.step()


def test_only_the_selected_state_moves() -> None:
    model, optimizer = _model_and_optimizer()
    backend = RecordingBackend(model, optimizer)
    with rollout_offload(_cfg(optimizer=False), model=model, optimizer=optimizer, backend=backend):
        backend.generate()
    backend.begin()
    with rollout_offload(_cfg(model=False), model=model, optimizer=optimizer, backend=backend):
        backend.generate()
    assert [e[1:] for e in backend.events if e[0] == "generate"] == [(True, False), (False, True)]


def test_state_returns_when_the_rollout_phase_raises() -> None:
    model, optimizer = _model_and_optimizer()
    before = {k: t.clone() for k, t in _tensors(model, optimizer).items()}
    backend = RecordingBackend(model, optimizer)
    with (
        pytest.raises(RuntimeError, match="engine died"),
        rollout_offload(_cfg(), model=model, optimizer=optimizer, backend=backend),
    ):
        raise RuntimeError("engine died")
    after = _tensors(model, optimizer)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert [e[0] for e in backend.events] == ["sleep"]


def test_disabled_offload_still_puts_a_colocated_engine_to_sleep() -> None:
    model, optimizer = _model_and_optimizer()
    backend = RecordingBackend(model, optimizer)
    with rollout_offload(_cfg(enabled=False), model=model, optimizer=optimizer, backend=backend) as state:
        backend.generate()
    assert backend.events == [("generate", False, False), ("sleep", False, False)] and state.num_bytes == 0


def test_non_colocated_backends_are_a_no_op() -> None:
    model, optimizer = _model_and_optimizer()
    storage = {k: t.data_ptr() for k, t in _tensors(model, optimizer).items()}
    hf = HFBackend(model, tokenizer=None, eos_token_id=0, pad_token_id=0)
    with rollout_offload(_cfg(), model=model, optimizer=optimizer, backend=hf) as state:
        assert {k: t.data_ptr() for k, t in _tensors(model, optimizer).items()} == storage
    assert state.num_bytes == 0


def test_deepspeed_fails_fast_with_mitigations() -> None:
    model, optimizer = _model_and_optimizer()
    backend = RecordingBackend(model, optimizer)
    cfg = RollmatchConfig()
    cfg.rollout.offload = _cfg()
    cfg.training.deepspeed = "ds_zero3.json"
    with pytest.raises(ConfigError, match=r"offload\.enabled: false.*rollout_backend: hf.*ZeRO"):
        resolve_run(cfg, world_size=1, device_count=0, device_type="cpu", model_required=False)
    next(iter(model.parameters())).ds_id = 0  # what ZeRO-3 sets on partitioned parameters
    with pytest.raises(ConfigError, match="DeepSpeed ZeRO"):
        rollout_offload(_cfg(), model=model, optimizer=optimizer, backend=backend)
    assert backend.events == []
