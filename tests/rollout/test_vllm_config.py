"""Colocated vLLM configuration: every invalid setting fails fast with its key and fix (no engine start)."""

from __future__ import annotations

import sys

import pytest
import torch
from pydantic import ValidationError

from rollmatch.collectives import LocalCollectives
from rollmatch.config.resolved import resolve_run
from rollmatch.config.rollout_rules import resolve_sync_mode
from rollmatch.config.schema import RollmatchConfig
from rollmatch.errors import BackendError, ConfigError, ConfigProblem
from rollmatch.rollout.vllm_colocate import VllmColocateBackend
from rollmatch.rollout.vllm_engine import VllmEngine, collapse_placeholders
from rollmatch.rollout.vllm_settings import engine_settings_from_config, require_vllm

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU rules (device counts differ on GPU machines)"
)
KEY = "custom.extra.rollout_matching.vllm"


def _valid() -> RollmatchConfig:
    cfg = RollmatchConfig()
    cfg.rollout.vllm.tensor_parallel_size = 1
    return cfg


def _resolve(cfg: RollmatchConfig, *, world_size: int = 1, devices: int = 0) -> None:
    """The one door to a run (every rule), for ``devices`` GPUs (0: CPU), the checkpoint not required."""
    resolve_run(
        cfg,
        world_size=world_size,
        device_count=devices,
        device_type="cuda" if devices else "cpu",
        model_required=False,
    )


def _all_problems(cfg: RollmatchConfig, *, world_size: int = 1, devices: int = 0) -> list[ConfigProblem]:
    try:
        _resolve(cfg, world_size=world_size, devices=devices)
    except ConfigError as error:
        return error.problems
    return []


def _problems(cfg: RollmatchConfig, *, world_size: int = 1, devices: int = 0) -> dict[str, str]:
    """Key -> its fixes joined (a key may have several problems); ``devices`` GPUs (0: CPU)."""
    out: dict[str, str] = {}
    for p in _all_problems(cfg, world_size=world_size, devices=devices):
        out[p.key] = f"{out.get(p.key, '')} | {p.fix}"
    return out


def test_a_valid_cpu_config_has_no_problems() -> None:
    assert _problems(_valid()) == {}


def test_tensor_parallel_size_too_large_for_the_devices() -> None:
    assert f"{KEY}.tensor_parallel_size" not in _problems(RollmatchConfig())  # the default runs anywhere
    cfg = RollmatchConfig()
    cfg.rollout.vllm.tensor_parallel_size = 4
    assert "set tensor_parallel_size: 1" in _problems(cfg)[f"{KEY}.tensor_parallel_size"]
    assert "tensor_parallel_size <= 2" in _problems(cfg, devices=2)[f"{KEY}.tensor_parallel_size"]


def test_tensor_parallel_groups_must_divide_the_world() -> None:
    cfg = _valid()
    cfg.rollout.vllm.tensor_parallel_size = 2
    assert "multiple of 2" in _problems(cfg, world_size=3, devices=2)[f"{KEY}.tensor_parallel_size"]
    assert _problems(cfg, world_size=4, devices=2) == {}


@pytest.mark.parametrize("value", [0.0, -0.1, 1.5])
def test_gpu_memory_utilization_outside_unit_interval(value: float) -> None:
    cfg = _valid()
    with pytest.raises(ValidationError, match="gpu_memory_utilization"):  # a schema bound
        cfg.rollout.vllm.gpu_memory_utilization = value


def test_max_model_len_below_global_max_length() -> None:
    cfg = _valid()
    cfg.rollout.vllm.max_model_len = 1024
    assert "global_max_length=2048" in _problems(cfg)[f"{KEY}.max_model_len"]
    cfg.rollout.vllm.max_model_len = 2048
    assert _problems(cfg) == {}


def test_adapter_sync_needs_enable_lora_and_a_lora_model() -> None:
    cfg = _valid()
    cfg.rollout.vllm.sync.mode = "adapter"
    assert "enable_lora: true" in _problems(cfg)[f"{KEY}.sync.mode"]
    cfg.rollout.vllm.sync.mode = "auto"
    cfg.rollout.vllm.enable_lora = True
    assert resolve_sync_mode(cfg) == "adapter"
    assert "model.lora.enabled" in _problems(cfg)[f"{KEY}.enable_lora"]
    cfg.model.lora.enabled = True
    assert _problems(cfg) == {}
    cfg.model.lora.use_dora = True
    assert "DoRA" in _problems(cfg)[f"{KEY}.sync.mode"]


def test_auto_sync_without_enable_lora_is_full() -> None:
    cfg = _valid()
    cfg.rollout.vllm.sync.mode = "auto"
    assert resolve_sync_mode(cfg) == "full"


def test_sleep_mode_needs_a_gpu_and_level_2_needs_full_sync() -> None:
    cfg = _valid()
    cfg.rollout.vllm.sleep_level = 1
    assert "set it to 0 on CPU" in _problems(cfg)[f"{KEY}.sleep_level"]
    cfg.rollout.vllm.sleep_level = 2
    cfg.rollout.vllm.enable_lora = True
    cfg.model.lora.enabled = True
    cfg.rollout.vllm.sync.mode = "adapter"
    fixes = [p.fix for p in _all_problems(cfg)]
    assert any("sleep_level 1" in f for f in fixes) and any("on CPU" in f for f in fixes)


def test_missing_vllm_says_how_to_install_or_switch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without vLLM looks like
    with pytest.raises(ConfigError) as info:
        require_vllm()  # what a colocated backend checks when it is built
    (problem,) = info.value.problems
    assert problem.key == "custom.extra.rollout_matching.rollout_backend"
    assert "pip install" in problem.fix and "rollout_backend: hf" in problem.fix
    with pytest.raises(BackendError, match="not installed"):
        VllmEngine("/nonexistent").start()


def test_all_problems_are_reported_at_once() -> None:
    cfg = RollmatchConfig()
    cfg.rollout.vllm.tensor_parallel_size = 4  # on CPU
    cfg.rollout.vllm.sleep_level = 1
    cfg.rollout.vllm.max_model_len = 16
    with pytest.raises(ConfigError) as info:
        _resolve(cfg)
    assert len(info.value.problems) == 3


def test_from_config_validates_then_builds_a_lazy_engine() -> None:
    cfg = _valid()
    cfg.data.max_pixels = 100_000
    cfg.rollout.vllm.enable_lora = True
    cfg.model.lora.enabled = True
    cfg.model.lora.r = 16
    cfg.model.path = "m"
    cfg.data.coord_frame = "norm1000"  # "m" is no checkpoint: nothing to resolve auto from
    run = resolve_run(cfg, world_size=1, device_count=0, device_type="cpu")
    backend = VllmColocateBackend.from_config(
        run, model=torch.nn.Linear(2, 2), tokenizer=None, collectives=LocalCollectives()
    )
    settings = backend.engine.settings
    assert not backend.engine.started and backend.weight_version == 0
    assert backend.sync_mode == "full"  # sync.mode full is the default even with enable_lora
    assert settings == engine_settings_from_config(cfg, "m")
    assert (settings.max_model_len, settings.dtype, settings.enforce_eager, settings.max_lora_rank) == (
        2048,
        "float32",
        True,
        16,
    )
    assert settings.mm_processor_kwargs == {"max_pixels": 100_000}
    with pytest.raises(ConfigError):  # tensor_parallel_size 4 on CPU: refused before any backend is built
        resolve_run(RollmatchConfig(), world_size=1, device_count=0, device_type="cpu")


def test_collapse_placeholders_keeps_one_token_per_image_run() -> None:
    assert collapse_placeholders([1, 9, 9, 9, 2, 9, 9, 3, 9], 9) == [1, 9, 2, 9, 3, 9]
    assert collapse_placeholders([1, 2], 9) == [1, 2]


def test_executor_backend_follows_the_process_layout() -> None:
    from rollmatch.rollout.vllm_engine import executor_backend

    assert executor_backend(1, learner_world_size=1) == "uni"  # one process, one device
    assert executor_backend(2, learner_world_size=1) == "mp"  # a rollout server sharded over 2 GPUs
    assert executor_backend(1, learner_world_size=4) == "external_launcher"  # colocated under torchrun
    assert executor_backend(4, learner_world_size=4) == "external_launcher"
