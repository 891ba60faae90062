"""The rollout engine's and Channel-B's rules: weight sync, the pipeline, async actors, step mode,
offload, the engine's memory, and their runtime rules against the launch.

Owns :func:`resolve_sync_mode` (the weight-sync mode in force), the static rules on those keys (each
docstring is its line in docs/config.md) and the runtime ones (world size, devices) that
``config.rules.check_runtime`` runs. Leaves out: which engine keys take effect in which mode
(``config.engine_rules``) and the servers (``config.server_rules``).
"""

from __future__ import annotations

from typing import Literal

from rollmatch.config.schema import ROLLOUT_KEY, RollmatchConfig
from rollmatch.errors import ConfigProblem

_RM = ROLLOUT_KEY
_VLLM = f"{_RM}.vllm"
_CHANNEL_B = "stage2_ab.channel_b"


def sync_mode_problems(cfg: RollmatchConfig, *, world_size: int) -> list[ConfigProblem]:
    """The weight-sync mode in force against the world size: several learner processes need full sync."""
    if world_size <= 1 or resolve_sync_mode(cfg) != "adapter":
        return []
    sync_mode = cfg.rollout.vllm.sync.mode
    why_adapter = (
        " (auto resolves to adapter because vllm.enable_lora is true)" if sync_mode == "auto" else ""
    )
    return [
        ConfigProblem(
            f"{_VLLM}.sync.mode",
            sync_mode,
            f"set {_VLLM}.sync.mode: full: with world_size={world_size} multi-process learners support "
            f"only full sync{why_adapter}",
        )
    ]


def resolve_sync_mode(cfg: RollmatchConfig) -> Literal["full", "adapter"]:
    """The weight-sync mode in force: ``auto`` is adapter iff ``vllm.enable_lora`` is true."""
    vllm = cfg.rollout.vllm
    if vllm.sync.mode == "auto":
        return "adapter" if vllm.enable_lora else "full"
    return vllm.sync.mode


def rule_lora_sync(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """`vllm.sync.mode: adapter` needs `vllm.enable_lora: true`, which needs `model.lora.enabled: true`; adapter sync (also `auto` with `enable_lora`) refuses DoRA and `vllm.sleep_level: 2`."""
    vllm = cfg.rollout.vllm
    problems: list[ConfigProblem] = []
    if resolve_sync_mode(cfg) == "adapter" and cfg.model.lora.use_dora:
        problems.append(
            ConfigProblem(
                f"{_VLLM}.sync.mode",
                vllm.sync.mode,
                f"vLLM cannot serve DoRA adapters: set {_VLLM}.sync.mode: full (DoRA is merged into full "
                "weights), or model.lora.use_dora: false",
            )
        )
    if resolve_sync_mode(cfg) == "adapter" and vllm.sleep_level == 2:
        problems.append(
            ConfigProblem(
                f"{_VLLM}.sleep_level",
                2,
                "level 2 discards the base weights, which adapter sync never resends: use sleep_level 1 "
                f"or {_VLLM}.sync.mode: full",
            )
        )
    if vllm.sync.mode == "adapter" and not vllm.enable_lora:
        problems.append(
            ConfigProblem(
                f"{_VLLM}.sync.mode",
                "adapter",
                f"adapter sync needs an engine that serves LoRA: set {_VLLM}.enable_lora: true, "
                f"or set {_VLLM}.sync.mode: full",
            )
        )
    if vllm.enable_lora and not cfg.model.lora.enabled:
        problems.append(
            ConfigProblem(
                f"{_VLLM}.enable_lora",
                True,
                "the engine can only serve adapters the model trains: set model.lora.enabled: true, "
                f"or set {_VLLM}.enable_lora: false",
            )
        )
    return problems


def rule_pipeline(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """`stage2_ab.channel_b.enable_pipeline` needs `channel_b.mode: step`, `rollout_backend: vllm` and `vllm.mode: server`."""
    channel_b = cfg.stage2_ab.channel_b
    if not channel_b.enable_pipeline:
        return []
    problems: list[ConfigProblem] = []
    if channel_b.mode != "step":
        problems.append(
            ConfigProblem(
                f"{_CHANNEL_B}.enable_pipeline",
                True,
                f"the pipeline overlaps rollouts and learning inside one step-mode optimizer step; set "
                f"{_CHANNEL_B}.mode: step, or set enable_pipeline: false (mode is {channel_b.mode!r})",
            )
        )
    if cfg.rollout.rollout_backend != "vllm" or cfg.rollout.vllm.mode != "server":
        problems.append(
            ConfigProblem(
                f"{_CHANNEL_B}.enable_pipeline",
                True,
                "running rollouts concurrently with training on the same device is unsafe (the engine and "
                f"the learner contend for memory and weights); set {_RM}.rollout_backend: vllm and "
                f"{_VLLM}.mode: server (rollouts on dedicated devices), or set enable_pipeline: false",
            )
        )
    return problems


def rule_async(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """`stage2_ab.channel_b.mode: async` needs `rollout_backend: vllm`, `vllm.mode: server` and full sync."""
    if cfg.stage2_ab.channel_b.mode != "async":
        return []
    rm = cfg.rollout
    if rm.rollout_backend == "vllm" and rm.vllm.mode == "server" and resolve_sync_mode(cfg) == "full":
        return []
    return [
        ConfigProblem(
            f"{_CHANNEL_B}.mode",
            "async",
            f"async actors need rollout servers and full weight sync: set {_RM}.rollout_backend: vllm, "
            f"{_VLLM}.mode: server and {_VLLM}.sync.mode: full (got rollout_backend={rm.rollout_backend}, "
            f"vllm.mode={rm.vllm.mode}, sync={resolve_sync_mode(cfg)}), or use channel_b.mode: micro",
        )
    ]


def rule_async_queue(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """`stage2_ab.channel_b.async.prefetch_target_packs` <= `queue_limit` (the actor cannot keep more packs ready than the queue holds)."""
    settings = cfg.stage2_ab.channel_b.async_
    if cfg.stage2_ab.channel_b.mode != "async" or settings.prefetch_target_packs <= settings.queue_limit:
        return []
    return [
        ConfigProblem(
            f"{_CHANNEL_B}.async.prefetch_target_packs",
            settings.prefetch_target_packs,
            f"more than {_CHANNEL_B}.async.queue_limit = {settings.queue_limit}: the queue would drop the "
            "packs the actor keeps ready; raise queue_limit or lower prefetch_target_packs",
        )
    ]


def rule_step_mode(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """`stage2_ab.channel_b.rollouts_per_step` is read only by `channel_b.mode: step`; step mode refuses `training.deepspeed`."""
    channel_b = cfg.stage2_ab.channel_b
    problems: list[ConfigProblem] = []
    if channel_b.rollouts_per_step is not None and channel_b.mode != "step":
        problems.append(
            ConfigProblem(
                f"{_CHANNEL_B}.rollouts_per_step",
                channel_b.rollouts_per_step,
                f"only step mode reads it (mode is {channel_b.mode!r}: rollouts follow the micro-batches); "
                f"delete it, or set {_CHANNEL_B}.mode: step",
            )
        )
    if channel_b.mode == "step" and cfg.training.deepspeed is not None:
        problems.append(
            ConfigProblem(
                "training.deepspeed",
                cfg.training.deepspeed,
                "step mode runs a variable number of backward passes inside one micro-step, which DeepSpeed's "
                f"accumulation bookkeeping cannot follow; unset training.deepspeed or use {_CHANNEL_B}.mode: micro",
            )
        )
    return problems


def rule_offload(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """Rollout offload (`offload.enabled` with `offload_model` or `offload_optimizer`, colocated vLLM) refuses `training.deepspeed`."""
    return offload_problems(cfg)


def offload_problems(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """The config's part of the offload safety check (``training.offload`` adds the runtime part)."""
    rm, off = cfg.rollout, cfg.rollout.offload
    colocated = rm.rollout_backend == "vllm" and rm.vllm.mode == "colocate"
    moves_state = off.enabled and (off.offload_model or off.offload_optimizer)
    if not (colocated and moves_state and cfg.training.deepspeed):
        return []
    return [
        ConfigProblem(
            "training.deepspeed",
            cfg.training.deepspeed,
            "DeepSpeed ZeRO manages (partitioned) parameters and optimizer buffers that rollout offload "
            f"cannot move safely: set `{_RM}.offload.enabled: false`, or `{_RM}.rollout_backend: hf`, or "
            "train without DeepSpeed ZeRO (DDP) / without its stage 3",
        )
    ]


def rule_engine_memory(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """`vllm.max_model_len`, when set, >= `training.global_max_length`."""
    vllm = cfg.rollout.vllm
    problems: list[ConfigProblem] = []
    if vllm.max_model_len is not None and vllm.max_model_len < cfg.training.global_max_length:
        problems.append(
            ConfigProblem(
                f"{_VLLM}.max_model_len",
                vllm.max_model_len,
                f"below training.global_max_length={cfg.training.global_max_length}: the engine could not hold "
                f"a full training sample; set max_model_len >= {cfg.training.global_max_length} or null",
            )
        )
    return problems


def async_gas_problems(cfg: RollmatchConfig, *, world_size: int) -> list[ConfigProblem]:
    """A B step in async mode takes one ready pack per micro-step: the actor must keep that many ready."""
    if cfg.custom.trainer_variant != "stage2_ab_training" or cfg.stage2_ab.channel_b.mode != "async":
        return []
    gas = cfg.training.gradient_accumulation(world_size)
    target = cfg.stage2_ab.channel_b.async_.prefetch_target_packs
    if target >= gas:
        return []
    return [
        ConfigProblem(
            f"{_CHANNEL_B}.async.prefetch_target_packs",
            target,
            f"below gradient_accumulation_steps = {gas} (world_size={world_size}): a B step takes one ready pack "
            f"per micro-step, so the actors would never keep enough ready; set prefetch_target_packs >= {gas} "
            "(and queue_limit >= it)",
        )
    ]


def colocated_engine_problems(
    cfg: RollmatchConfig, *, world_size: int, device_count: int, device_type: str
) -> list[ConfigProblem]:
    rm = cfg.rollout
    # Stage-1 SFT makes no rollouts, so the engine settings are not in force.
    if cfg.custom.trainer_variant == "sft" or rm.rollout_backend != "vllm" or rm.vllm.mode != "colocate":
        return []
    problems: list[ConfigProblem] = []
    tp = rm.vllm.tensor_parallel_size
    key = f"{_VLLM}.tensor_parallel_size"
    if device_type == "cpu" and tp != 1:
        problems.append(
            ConfigProblem(key, tp, "the vLLM CPU engine runs unsharded: set tensor_parallel_size: 1")
        )
    elif device_type != "cpu" and tp > device_count:
        problems.append(
            ConfigProblem(
                key,
                tp,
                f"only {device_count} {device_type} device(s) visible to a colocated engine; set "
                f"tensor_parallel_size <= {device_count}, or use vllm.mode: server on dedicated devices",
            )
        )
    elif tp > 1 and world_size % tp:
        problems.append(
            ConfigProblem(
                key,
                tp,
                f"a colocated engine spans {tp} learner ranks, but the world size is {world_size}: launch a "
                f"multiple of {tp} ranks with torchrun, or set it to 1",
            )
        )
    if device_type == "cpu" and rm.vllm.sleep_level:
        problems.append(
            ConfigProblem(
                f"{_VLLM}.sleep_level", rm.vllm.sleep_level, "vLLM sleep mode needs a GPU: set it to 0 on CPU"
            )
        )
    return problems
