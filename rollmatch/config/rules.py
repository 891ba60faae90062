"""Every cross-field config rule, behind one door: :func:`check_run`.

Owns :func:`check_run` (static and runtime rules together, what ``config.resolved.resolve_run`` runs
once per run, so ``rollmatch check-config`` and ``rollmatch train`` refuse the same configs),
:func:`check_config` (the static rules alone: the rules that need only the config, also run by a
loader that already found field errors, so every problem is reported at once) and
:func:`check_runtime` (the rules that need the world size and devices; ``launch`` runs them for the
world size it gives the learner), and the static rules of no other home. Each returns
:class:`~rollmatch.errors.ConfigProblem` s and never raises. Leaves out: per-field types and ranges
(pydantic, ``config.schema``), moved / removed keys (``config.legacy``), the rules grouped by
concept elsewhere (``server_rules``, ``rollout_rules``, ``engine_rules``, ``wait_rules``,
``objective_rules``, ``launch_rules``, ``hf_args``, ``sharding``, ``precision``).

Each static rule function's docstring is its one-line description in docs/config.md.
"""

from __future__ import annotations

from collections.abc import Callable

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
from rollmatch.config.rollout_rules import (
    async_gas_problems,
    colocated_engine_problems,
    rule_async,
    rule_async_queue,
    rule_engine_memory,
    rule_lora_sync,
    rule_offload,
    rule_pipeline,
    rule_step_mode,
    sync_mode_problems,
)
from rollmatch.config.schema import RollmatchConfig
from rollmatch.config.server_rules import min_healthy_problems, resolved_server_count, rule_servers
from rollmatch.config.sharding import sharding_problems
from rollmatch.config.wait_rules import first_push_problems, rule_async_on_policy, rule_async_wait
from rollmatch.errors import ConfigProblem

_CHANNEL_B = "stage2_ab.channel_b"

Rule = Callable[[RollmatchConfig], list[ConfigProblem]]


# ------------------------------------------------------------------------------------ public entry
def check_run(
    cfg: RollmatchConfig, *, world_size: int, device_count: int, device_type: str
) -> list[ConfigProblem]:
    """Every problem of ``cfg`` run on this launch: the static rules, then the runtime ones
    (:func:`check_runtime`) and ``vllm.server.min_healthy`` against the configured servers."""
    problems = check_config(cfg)
    problems.extend(
        check_runtime(cfg, world_size=world_size, device_count=device_count, device_type=device_type)
    )
    servers = resolved_server_count(cfg.rollout.vllm.server)
    if servers:
        problems.extend(min_healthy_problems(cfg.rollout.vllm.server.min_healthy, servers))
    return problems


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
    problems.extend(async_gas_problems(cfg, world_size=world_size))
    problems.extend(first_push_problems(cfg, world_size=world_size))
    problems.extend(
        colocated_engine_problems(
            cfg, world_size=world_size, device_count=device_count, device_type=device_type
        )
    )
    problems.extend(eval_runtime_problems(cfg, world_size=world_size))
    return problems


# -------------------------------------------------------------------------------------- static rules
def rule_b_ratio_required(cfg: RollmatchConfig) -> list[ConfigProblem]:
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


def rule_pixels(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """`data.min_pixels` <= `data.max_pixels` when both are set."""
    low, high = cfg.data.min_pixels, cfg.data.max_pixels
    if low is None or high is None or low <= high:
        return []
    return [ConfigProblem("data.min_pixels", low, f"must not exceed data.max_pixels (= {high}); lower it")]


def rule_freeze(cfg: RollmatchConfig) -> list[ConfigProblem]:
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


def rule_target(cfg: RollmatchConfig) -> list[ConfigProblem]:
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


def rule_coord_tokens(cfg: RollmatchConfig) -> list[ConfigProblem]:
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


STATIC_RULES: tuple[Rule, ...] = (
    rule_b_ratio_required,
    rule_freeze,
    rule_servers,
    rule_lora_sync,
    rule_pipeline,
    rule_async,
    rule_async_queue,
    rule_async_wait,
    rule_async_on_policy,
    rule_step_mode,
    rule_offload,
    rule_pixels,
    rule_target,
    rule_coord_tokens,
    rule_engine_memory,
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
