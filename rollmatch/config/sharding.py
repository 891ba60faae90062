"""Parameter sharding engines (DeepSpeed ZeRO-3, FSDP2) and what runs with them, decided at config load.

Under ZeRO-3 or FSDP every rank holds a shard of each parameter, so exporting weights for a rollout
engine is a collective: every rank takes part in the same per-bucket gathers (``sync.weights``). What
that allows, and what is refused here (not at the first weight sync):

| engine | supported | refused |
| --- | --- | --- |
| none, DDP, ZeRO-1/2 | everything | — |
| ZeRO-3, FSDP2 | full sync to rollout servers or a colocated vLLM engine | `rollout_backend: hf` (generation on sharded parameters), adapter sync, LoRA, `vllm.sleep_level: 2` |
| FSDP1 (`fsdp_config.version: 1`) | — | always (flat parameters cannot be exported per tensor) |

Owns: :func:`parameter_sharding` (which engine a config asks for: the DeepSpeed JSON's
``zero_optimization.stage``, ``training.hf_args.fsdp``) and :func:`sharding_problems`.
Leaves out: gathering itself (``sync.weights``) and DeepSpeed's own config checks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from rollmatch.config.schema import ROLLOUT_KEY, RollmatchConfig
from rollmatch.errors import ConfigProblem

Sharding = Literal["none", "zero3", "fsdp2", "fsdp1"]
_RM = ROLLOUT_KEY


def parameter_sharding(cfg: RollmatchConfig) -> Sharding:
    """Which parameter sharding the config asks for (an unreadable DeepSpeed file counts as none)."""
    fsdp = cfg.training.hf_args.get("fsdp")
    if fsdp:
        fsdp_config = cfg.training.hf_args.get("fsdp_config") or {}
        version = fsdp_config.get("version", 2) if isinstance(fsdp_config, dict) else 2
        return "fsdp1" if int(version) == 1 else "fsdp2"
    stage = _zero_stage(cfg.training.deepspeed)
    return "zero3" if isinstance(stage, int) and stage == 3 else "none"


def sharding_problems(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """`training.deepspeed` must be a readable JSON file; under ZeRO-3 / FSDP2 weights reach a rollout engine only by full sync of full weights (no LoRA) to vLLM (servers or colocate, `sleep_level` < 2); FSDP1 is refused."""
    problems: list[ConfigProblem] = []
    path = cfg.training.deepspeed
    if path is not None and isinstance(_zero_stage(path), str):
        problems.append(ConfigProblem("training.deepspeed", path, str(_zero_stage(path))))
    sharding = parameter_sharding(cfg)
    if sharding == "fsdp1":
        problems.append(
            ConfigProblem(
                "training.hf_args.fsdp_config.version",
                1,
                "FSDP1 keeps flat parameter shards that weight sync cannot export per tensor: use FSDP2 "
                "(fsdp_config.version: 2, the default)",
            )
        )
    if sharding not in ("zero3", "fsdp2") or not _rolls_out(cfg):
        return problems
    engine = "DeepSpeed ZeRO-3" if sharding == "zero3" else "FSDP2"
    rm = cfg.rollout
    if rm.rollout_backend == "hf":
        problems.append(
            ConfigProblem(
                f"{_RM}.rollout_backend",
                "hf",
                f"under {engine} the parameters are sharded over ranks, and HF generate would gather every layer "
                f"at every token on every rank in lock-step: set {_RM}.rollout_backend: vllm (colocate or server), "
                "or train without parameter sharding",
            )
        )
        return problems
    if rm.vllm.sync.mode == "adapter" or (rm.vllm.sync.mode == "auto" and rm.vllm.enable_lora):
        problems.append(
            ConfigProblem(
                f"{_RM}.vllm.sync.mode",
                rm.vllm.sync.mode,
                f"under {engine} weights are gathered per bucket for full sync only: set {_RM}.vllm.sync.mode: full",
            )
        )
    if cfg.model.lora.enabled:
        problems.append(
            ConfigProblem(
                "model.lora.enabled",
                True,
                f"under {engine} full sync exports whole base weights and cannot merge LoRA adapters into their "
                "shards: train full weights, or LoRA without parameter sharding (ZeRO-2 / DDP)",
            )
        )
    if rm.vllm.mode == "colocate" and rm.vllm.sleep_level == 2:
        problems.append(
            ConfigProblem(
                f"{_RM}.vllm.sleep_level",
                2,
                f"a level-2 wake-up reloads weights inside one rank's generate call, but under {engine} loading "
                "weights is a gather every rank must join: use sleep_level 0 or 1",
            )
        )
    return problems


def _rolls_out(cfg: RollmatchConfig) -> bool:
    """The run builds a rollout backend: a variant that rolls out, or in-training evaluation."""
    from rollmatch.config.hf_args import eval_strategy

    return cfg.custom.trainer_variant != "sft" or eval_strategy(cfg) != "no"


def _zero_stage(path: str | None) -> int | str | None:
    """``zero_optimization.stage`` of a DeepSpeed JSON (None: not set), or a message why it is unreadable."""
    if path is None:
        return None
    file = Path(path).expanduser()
    if not file.is_file():
        return (
            f"DeepSpeed config file not found: {file.resolve()} (a config file's relative paths resolve "
            "against its directory, an override's against the working directory)"
        )
    try:
        data: Any = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"not a readable DeepSpeed JSON config: {exc}"
    zero = data.get("zero_optimization", {}) if isinstance(data, dict) else {}
    stage = zero.get("stage") if isinstance(zero, dict) else None
    if stage is None or stage == "auto":
        return None
    try:
        return int(stage)
    except (TypeError, ValueError):
        return f"zero_optimization.stage must be 0-3, got {stage!r}"
