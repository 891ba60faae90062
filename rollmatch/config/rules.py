"""Cross-field config rules: each returns :class:`~rollmatch.errors.ConfigProblem` s, never raises.

Owns: the static rules that need only the config (:func:`check_config`, run by every loader), the
runtime rules that need the world size and devices (:func:`check_runtime`, run once per run by
``config.resolved.resolve_run``), the normalised rollout-server list (:func:`resolve_servers`) and
the sync mode in force (:func:`resolve_sync_mode`). Leaves out: per-field types and ranges
(pydantic, ``config.schema``) and moved / removed keys (``config.legacy``).

Each rule function's docstring is its one-line description in docs/config.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal
from urllib.parse import urlparse

from rollmatch.config.engine_rules import rule_engine_keys_in_mode
from rollmatch.config.hf_args import (
    dry_build_problems,
    eval_problems,
    eval_runtime_problems,
    hf_args_problems,
)
from rollmatch.config.launch_rules import launch_problems
from rollmatch.config.objective_rules import rule_grpo, rule_noise_objects, rule_rollouts_per_record
from rollmatch.config.precision import rule_mixed_precision
from rollmatch.config.schema import ROLLOUT_KEY, RollmatchConfig, ServerConfig, ServerEndpoint
from rollmatch.config.sharding import sharding_problems
from rollmatch.config.wait_rules import first_push_problems, rule_async_on_policy, rule_async_wait
from rollmatch.errors import ConfigError, ConfigProblem

_RM = ROLLOUT_KEY
_VLLM = f"{_RM}.vllm"
_SERVER = f"{_VLLM}.server"
_CHANNEL_B = "stage2_ab.channel_b"

Rule = Callable[[RollmatchConfig], list[ConfigProblem]]


# ------------------------------------------------------------------------------------ public entry
def check_config(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """Every problem the static rules find (empty list: the config is consistent)."""
    return [problem for rule in STATIC_RULES for problem in rule(cfg)]


def check_runtime(
    cfg: RollmatchConfig, *, world_size: int, device_count: int, device_type: str
) -> list[ConfigProblem]:
    """Problems that depend on the launch: world size, number and type (``cpu``/``cuda``) of devices.

    ``device_count`` is the number of visible accelerators (0 on a CPU machine).
    """
    problems = sync_mode_problems(cfg, world_size=world_size)
    if world_size > 1 and cfg.stage2_ab.channel_b.mode == "step":
        problems.append(
            ConfigProblem(
                f"{_CHANNEL_B}.mode",
                "step",
                f"set {_CHANNEL_B}.mode: async (step mode learns to completion on one process and cannot "
                f"keep world_size={world_size} ranks in lock-step), or launch a single process",
            )
        )
    problems.extend(_async_gas_problems(cfg, world_size=world_size))
    problems.extend(first_push_problems(cfg, world_size=world_size))
    problems.extend(
        _colocated_engine_problems(
            cfg, world_size=world_size, device_count=device_count, device_type=device_type
        )
    )
    problems.extend(eval_runtime_problems(cfg, world_size=world_size))
    return problems


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


def validate_runtime(cfg: RollmatchConfig, *, world_size: int, device_count: int, device_type: str) -> None:
    """Raise one :class:`ConfigError` listing every :func:`check_runtime` problem."""
    problems = check_runtime(cfg, world_size=world_size, device_count=device_count, device_type=device_type)
    if problems:
        raise ConfigError(problems)


def resolve_sync_mode(cfg: RollmatchConfig) -> Literal["full", "adapter"]:
    """The weight-sync mode in force: ``auto`` is adapter iff ``vllm.enable_lora`` is true."""
    vllm = cfg.rollout.vllm
    if vllm.sync.mode == "auto":
        return "adapter" if vllm.enable_lora else "full"
    return vllm.sync.mode


def resolve_servers(server_cfg: ServerConfig) -> list[ServerEndpoint]:
    """The rollout servers as one list, whichever form configured them (empty: none configured).

    Legacy form: ``base_url`` str or list, ``group_port`` int (server ``i`` gets ``group_port + i``)
    or a list of the same length. Raises :class:`ConfigError` on any :func:`server_problems`.
    """
    problems = server_problems(server_cfg)
    if problems:
        raise ConfigError(problems)
    if server_cfg.servers is not None:
        return [endpoint.model_copy() for endpoint in server_cfg.servers]
    urls = _legacy_urls(server_cfg)
    return [
        ServerEndpoint(base_url=url, group_port=port)
        for url, port in zip(urls, _legacy_ports(server_cfg, len(urls)), strict=True)
    ]


def min_healthy_problems(min_healthy: int | None, servers: int) -> list[ConfigProblem]:
    """``vllm.server.min_healthy`` above the run's ``servers`` (a floor the run could never meet). Checked
    where the servers are known: the resolved run (``config.resolved``) and a launch's plan."""
    if min_healthy is None or min_healthy <= servers:
        return []
    return [
        ConfigProblem(
            f"{_SERVER}.min_healthy",
            min_healthy,
            f"the run has {servers} rollout server(s), fewer than it needs healthy: set it between 1 and "
            f"{servers}, or null (every server must stay healthy)",
        )
    ]


def server_problems(server_cfg: ServerConfig) -> list[ConfigProblem]:
    """Every problem of the server section alone (forms, pairing, ports, URLs)."""
    problems: list[ConfigProblem] = []
    legacy_set = server_cfg.base_url is not None or server_cfg.group_port is not None
    if server_cfg.servers is not None and legacy_set:
        problems.append(
            ConfigProblem(
                f"{_SERVER}.servers",
                [s.base_url for s in server_cfg.servers],
                f"both `servers` and legacy `base_url`/`group_port` are set under {_SERVER}; keep only `servers`",
            )
        )
        return problems
    if server_cfg.servers is not None:
        endpoints = [(s.base_url, s.group_port) for s in server_cfg.servers]
        return problems + _endpoint_problems(endpoints, f"{_SERVER}.servers")
    if legacy_set:
        problems.extend(_legacy_problems(server_cfg))
    return problems


# -------------------------------------------------------------------------------------- static rules
def _rule_b_ratio_required(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """`custom.trainer_variant: stage2_ab_training` requires `stage2_ab.schedule.b_ratio` (float in [0, 1])."""
    if cfg.custom.trainer_variant != "stage2_ab_training" or cfg.stage2_ab.schedule.b_ratio is not None:
        return []
    return [
        ConfigProblem(
            "stage2_ab.schedule.b_ratio",
            None,
            "required by custom.trainer_variant: stage2_ab_training; set the fraction of optimizer steps "
            "on Channel-B, a float in [0, 1] (e.g. 0.5)",
        )
    ]


def _rule_servers(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """Rollout servers: exactly one form (`servers` or legacy `base_url` + `group_port`), paired lists, unique URLs, no two servers on one host sharing a `group_port`; `vllm.mode: server` needs at least one server."""
    server_cfg = cfg.rollout.vllm.server
    problems = server_problems(server_cfg)
    configured = server_cfg.servers or server_cfg.base_url
    if cfg.rollout.vllm.mode == "server" and not configured:
        problems.append(
            ConfigProblem(
                f"{_SERVER}.servers",
                server_cfg.servers,
                f"{_VLLM}.mode is server but no rollout server is configured; set {_SERVER}.servers: "
                "[{base_url: http://HOST:PORT, group_port: PORT}], or use vllm.mode: colocate / rollout_backend: hf",
            )
        )
    return problems


def _rule_lora_sync(cfg: RollmatchConfig) -> list[ConfigProblem]:
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


def _rule_pipeline(cfg: RollmatchConfig) -> list[ConfigProblem]:
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


def _rule_async(cfg: RollmatchConfig) -> list[ConfigProblem]:
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


def _rule_async_queue(cfg: RollmatchConfig) -> list[ConfigProblem]:
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


def _rule_step_mode(cfg: RollmatchConfig) -> list[ConfigProblem]:
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


def _rule_offload(cfg: RollmatchConfig) -> list[ConfigProblem]:
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


def _rule_pixels(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """`data.min_pixels` <= `data.max_pixels` when both are set."""
    low, high = cfg.data.min_pixels, cfg.data.max_pixels
    if low is None or high is None or low <= high:
        return []
    return [ConfigProblem("data.min_pixels", low, f"must not exceed data.max_pixels (= {high}); lower it")]


def _rule_freeze(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """`training.freeze` leaves a group to train, has no multiplier for a frozen group, and not with LoRA."""
    train, problems = cfg.training, []
    frozen = set(train.freeze)
    if frozen == {"vision_tower", "merger", "language_model"}:
        problems.append(
            ConfigProblem("training.freeze", train.freeze, "freezes every group: leave one to train")
        )
    for group, factor in train.lr_multipliers.items():
        if group in frozen:
            problems.append(
                ConfigProblem(
                    f"training.lr_multipliers.{group}",
                    factor,
                    f"{group} is frozen (training.freeze); remove one",
                )
            )
        elif factor <= 0:
            problems.append(
                ConfigProblem(
                    f"training.lr_multipliers.{group}",
                    factor,
                    "must be > 0; freeze it with training.freeze instead",
                )
            )
    if cfg.model.lora.enabled and (frozen or train.lr_multipliers):
        problems.append(
            ConfigProblem(
                "training.freeze" if frozen else "training.lr_multipliers",
                train.freeze or train.lr_multipliers,
                "LoRA trains only its adapters (on the language model): set model.lora.enabled: false, or "
                "drop training.freeze / training.lr_multipliers",
            )
        )
    return problems


def _rule_target(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """`loss.matched_prefix: supervise` needs `loss.target: prefix_fn`; `loss.fp_unlikelihood_weight` > 0 needs `target: prefix_fn` with `keep_prefix: all` and a variant that rolls out; `loss.missed_weight` != 1 needs a variant that rolls out."""
    loss = cfg.loss
    problems: list[ConfigProblem] = []
    if loss.matched_prefix == "supervise" and loss.target != "prefix_fn":
        problems.append(
            ConfigProblem(
                "loss.matched_prefix",
                loss.matched_prefix,
                "applies to loss.target: prefix_fn only (reordered_gt already supervises every matched object); "
                "set matched_prefix: none, or target: prefix_fn",
            )
        )
    if loss.fp_unlikelihood_weight > 0 and (loss.target != "prefix_fn" or loss.keep_prefix != "all"):
        problems.append(
            ConfigProblem(
                "loss.fp_unlikelihood_weight",
                loss.fp_unlikelihood_weight,
                f"no false positive is ever kept in the context under target: {loss.target}, keep_prefix: "
                f"{loss.keep_prefix}; set loss.target: prefix_fn with loss.keep_prefix: all, or set it to 0",
            )
        )
    rolls_out = cfg.custom.trainer_variant != "sft"
    for key, value, default in (
        ("missed_weight", loss.missed_weight, 1.0),
        ("fp_unlikelihood_weight", loss.fp_unlikelihood_weight, 0.0),
    ):
        if not rolls_out and value != default:
            problems.append(
                ConfigProblem(
                    f"loss.{key}",
                    value,
                    "acts on rollout-matching targets and custom.trainer_variant: sft never rolls out; set "
                    f"it to {default:g}, or trainer_variant: rollout_matching_sft / stage2_ab_training",
                )
            )
    return problems


def _rule_coord_tokens(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """`custom.object_format: coord_tokens` needs `data.coord_frame: norm1000` (or `auto`, which is norm1000 with coordinate tokens); the coordinate-only loss terms (`loss.coord_w1_weight`, `loss.geometry_*`) need `coord_tokens`."""
    if cfg.custom.object_format == "coord_tokens":
        if cfg.data.coord_frame == "pixels":
            return [
                ConfigProblem(
                    "data.coord_frame",
                    cfg.data.coord_frame,
                    "custom.object_format: coord_tokens encodes k/999 of the image side; set data.coord_frame: norm1000 (or auto)",
                )
            ]
        return []
    loss = cfg.loss
    return [
        ConfigProblem(
            f"loss.{key}",
            getattr(loss, key),
            "acts on coordinate tokens only; set custom.object_format: coord_tokens, or set it to 0",
        )
        for key in ("coord_w1_weight", "geometry_l1_weight", "geometry_giou_weight")
        if getattr(loss, key) > 0
    ]


def _rule_engine_memory(cfg: RollmatchConfig) -> list[ConfigProblem]:
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


STATIC_RULES: tuple[Rule, ...] = (
    _rule_b_ratio_required,
    _rule_freeze,
    _rule_servers,
    _rule_lora_sync,
    _rule_pipeline,
    _rule_async,
    _rule_async_queue,
    rule_async_wait,
    rule_async_on_policy,
    _rule_step_mode,
    _rule_offload,
    _rule_pixels,
    _rule_target,
    _rule_coord_tokens,
    _rule_engine_memory,
    rule_engine_keys_in_mode,
    rule_mixed_precision,
    rule_rollouts_per_record,
    rule_grpo,
    rule_noise_objects,
    hf_args_problems,
    eval_problems,
    sharding_problems,
    launch_problems,
    dry_build_problems,  # last: only meaningful once the names and types above are right
)


def rule_descriptions() -> list[str]:
    """One line per static rule (their docstrings), for docs/config.md."""
    return [(rule.__doc__ or rule.__name__).strip() for rule in STATIC_RULES]


RUNTIME_RULE_DESCRIPTIONS: tuple[str, ...] = (
    "World size > 1: `vllm.sync.mode` must resolve to full (adapter, or auto with `enable_lora`, is refused).",
    "World size > 1: `stage2_ab.channel_b.mode: step` is refused; use async.",
    "Async mode: `stage2_ab.channel_b.async.prefetch_target_packs` >= the gradient accumulation steps in force "
    "(a B step takes one ready pack per micro-step).",
    "World size > 1 with rollout servers: `vllm.server.timeout_s` <= `training.collective_timeout_s` minus a "
    "margin (a tenth of it, at least 10 s): the other ranks wait in a collective while rank 0 forms the "
    "weight-sync group of the first push, which waits up to `timeout_s` for a server.",
    "`rollout_backend: vllm` with `vllm.mode: colocate` (trainer variants that roll out): "
    "`tensor_parallel_size` <= visible GPUs and dividing the world size, exactly 1 on CPU; "
    "`vllm.sleep_level` 0 on CPU.",
    "World size > 1 with in-training evaluation: a colocated vLLM engine must not span ranks "
    "(`tensor_parallel_size` 1), because rank 0 evaluates alone.",
)


# ------------------------------------------------------------------------------------ private helpers
def _async_gas_problems(cfg: RollmatchConfig, *, world_size: int) -> list[ConfigProblem]:
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


def _colocated_engine_problems(
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


def _legacy_urls(server_cfg: ServerConfig) -> list[str]:
    base_url = server_cfg.base_url
    if base_url is None:
        return []
    return [base_url] if isinstance(base_url, str) else list(base_url)


def _legacy_ports(server_cfg: ServerConfig, count: int) -> list[int]:
    group_port = server_cfg.group_port
    if group_port is None:
        return []
    if isinstance(group_port, int):
        return [group_port + i for i in range(count)]
    return list(group_port)


def _legacy_problems(server_cfg: ServerConfig) -> list[ConfigProblem]:
    urls = _legacy_urls(server_cfg)
    if server_cfg.base_url is None:
        return [
            ConfigProblem(
                f"{_SERVER}.group_port",
                server_cfg.group_port,
                f"group_port without base_url; prefer {_SERVER}.servers: [{{base_url: ..., group_port: ...}}]",
            )
        ]
    if server_cfg.group_port is None:
        return [
            ConfigProblem(
                f"{_SERVER}.base_url",
                server_cfg.base_url,
                "base_url without group_port (the weight-sync port); set group_port (int: server i uses "
                f"group_port + i), or use {_SERVER}.servers: [{{base_url: ..., group_port: ...}}]",
            )
        ]
    ports = _legacy_ports(server_cfg, len(urls))
    if len(ports) != len(urls):
        return [
            ConfigProblem(
                f"{_SERVER}.group_port",
                server_cfg.group_port,
                f"{len(ports)} group_port(s) for {len(urls)} base_url(s); give one port per base_url, "
                "or a single int (server i uses group_port + i)",
            )
        ]
    return _endpoint_problems(list(zip(urls, ports, strict=True)), f"{_SERVER}.base_url")


def _endpoint_problems(endpoints: list[tuple[str, int]], key: str) -> list[ConfigProblem]:
    problems: list[ConfigProblem] = []
    seen: set[str] = set()
    group_ports: dict[tuple[str, int], str] = {}
    for url, port in endpoints:
        normalised = url.rstrip("/")
        host = (urlparse(normalised).hostname or "").replace("localhost", "127.0.0.1")
        other = group_ports.setdefault((host, port), url)
        if other != url:
            problems.append(
                ConfigProblem(
                    key,
                    port,
                    f"{url} and {other} share group_port {port} on host {host}: each server's weight-sync group "
                    "needs its own port on its host; give every server on one host a different group_port",
                )
            )
        if not normalised.startswith(("http://", "https://")):
            problems.append(ConfigProblem(key, url, "a server URL must start with http:// or https://"))
        if normalised in seen:
            problems.append(ConfigProblem(key, url, "duplicate server URL; list each rollout server once"))
        seen.add(normalised)
        if not 0 < port < 65536:
            problems.append(ConfigProblem(key, port, f"group_port {port} of {url} is outside 1..65535"))
    return problems
