"""HF ``TrainingArguments`` under ``training:``: typed keys, trainer-controlled fields, and the pass-through.

Every field of the installed transformers' ``TrainingArguments`` is reachable from a config, in one of
three ways:

- **typed keys** (:data:`OWNED`): ``training.learning_rate``, ``training.eval_steps``, ``model.dtype`` ...
  are rollmatch's own keys, documented in docs/config.md; they set those HF fields;
- **controlled fields** (:data:`CONTROLLED`): the trainer must set them itself (the step planner's
  records, its loss normaliser, the devices it found); naming one is an error that says why;
- **``training.hf_args``**: any other field, passed through as written (``optim``, ``adam_beta2``,
  ``run_name``, ``torch_compile``, ``save_strategy``, ``load_best_model_at_end``, ``fsdp`` ...).

Owns: those tables, :func:`hf_args_problems` (unknown names with "did you mean", typed-key and controlled
duplicates, value types against the dataclass annotations), :func:`training_arguments_kwargs` (the one
mapping of a config onto ``TrainingArguments``) and :func:`dry_build_problems` (what transformers' own
``__post_init__`` refuses, found when the config loads instead of when training starts).
Leaves out: building the Trainer (``training.entry``) and the rules on parameter sharding
(``config.sharding``). transformers is imported lazily: configs without ``hf_args`` never pay for it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from typing import Any

from rollmatch.config.schema import RollmatchConfig
from rollmatch.errors import ConfigProblem

HF_ARGS = "training.hf_args"

# HF field -> the typed rollmatch key that sets it.
OWNED: dict[str, str] = {
    "output_dir": "training.output_dir",
    "per_device_train_batch_size": "training.per_device_train_batch_size",
    "gradient_accumulation_steps": "training.gradient_accumulation_steps (or training.effective_batch_size)",
    "learning_rate": "training.learning_rate",
    "weight_decay": "training.weight_decay",
    "warmup_steps": "training.warmup_ratio",
    "warmup_ratio": "training.warmup_ratio",
    "lr_scheduler_type": "training.lr_scheduler_type",
    "lr_scheduler_kwargs": "training.lr_scheduler_kwargs",
    "max_grad_norm": "training.max_grad_norm",
    "num_train_epochs": "training.num_train_epochs",
    "max_steps": "training.max_steps",
    "logging_steps": "training.logging_steps",
    "save_steps": "training.save_steps",
    "save_total_limit": "training.save_total_limit",
    "report_to": "training.report_to",
    "seed": "training.seed",
    "gradient_checkpointing": "training.gradient_checkpointing",
    "deepspeed": "training.deepspeed",
    "dataloader_num_workers": "training.dataloader_num_workers",
    "ddp_timeout": "training.collective_timeout_s",
    "resume_from_checkpoint": "training.resume_from_checkpoint",
    "eval_strategy": "training.eval_strategy",
    "eval_steps": "training.eval_steps",
    "metric_for_best_model": "training.metric_for_best_model",
    "bf16": "training.mixed_precision",
    "fp16": "training.mixed_precision",
}

_NOT_HF_EVAL = (
    "in-training evaluation is rollmatch's detection eval (training.eval_*, eval.*), not HF's prediction loop"
)
# HF field -> why the trainer sets it itself.
CONTROLLED: dict[str, str] = {
    "remove_unused_columns": "records reach the step planner whole, so rollmatch sets it to false",
    "ddp_find_unused_parameters": "every rank runs the same forward/backward passes over all parameters "
    "(rollmatch sets it to false)",
    "use_cpu": "the device is picked from the machine (CUDA when available, else CPU)",
    "average_tokens_across_devices": "the loss is normalised by the step's total loss weight over all micro-steps "
    "and ranks (docs/stage2.md), whatever HF would average",
    "include_num_input_tokens_seen": "micro-steps are planned rows, not HF input batches",
    "label_names": "targets and loss weights are built by rollmatch (detection/targets)",
    "length_column_name": "records have no length column; packing groups by length itself",
    "local_rank": "torchrun sets the rank",
    "per_device_eval_batch_size": f"{_NOT_HF_EVAL}; its batch size is eval.batch_size",
    "eval_accumulation_steps": _NOT_HF_EVAL,
    "prediction_loss_only": _NOT_HF_EVAL,
    "eval_do_concat_batches": _NOT_HF_EVAL,
    "include_for_metrics": _NOT_HF_EVAL,
    "batch_eval_metrics": _NOT_HF_EVAL,
    "eval_use_gather_object": _NOT_HF_EVAL,
}

# Metrics of the in-training evaluation that can pick the best checkpoint -> greater is better.
BEST_MODEL_METRICS: dict[str, bool] = {
    "eval/f1": True,
    "eval/precision": True,
    "eval/recall": True,
    "eval/mean_iou": True,
    "eval/map": True,
    "eval/map_50": True,
    "eval/map_75": True,
    "eval/map_uniform_score": True,
    "eval/map_50_uniform_score": True,
    "eval/map_75_uniform_score": True,
    "eval/count_mae": False,
    "eval/truncated_frac": False,
}


# ------------------------------------------------------------------------------------ public entry
def eval_strategy(cfg: RollmatchConfig) -> str:
    """The evaluation strategy in force: ``training.eval_strategy``, or ``steps`` iff ``eval_steps`` is set."""
    t = cfg.training
    if t.eval_strategy is not None:
        return t.eval_strategy
    return "steps" if t.eval_steps is not None else "no"


def hf_metric_name(metric: str) -> str:
    """``eval/f1`` -> ``eval_f1``: the key HF's best-model tracking reads from ``evaluate()``'s result."""
    return metric.replace("/", "_", 1)


def training_arguments_kwargs(cfg: RollmatchConfig, gas: int, *, use_cpu: bool) -> dict[str, Any]:
    """Every keyword rollmatch passes to ``TrainingArguments``: typed keys, controlled fields, ``hf_args``."""
    t = cfg.training
    kwargs: dict[str, Any] = {
        "save_strategy": "steps",  # defaults that hf_args may change
        "disable_tqdm": False,
        **t.hf_args,
        "output_dir": t.output_dir,
        "per_device_train_batch_size": t.per_device_train_batch_size,
        "gradient_accumulation_steps": gas,
        "learning_rate": t.learning_rate,
        "weight_decay": t.weight_decay,
        "warmup_steps": t.warmup_ratio,  # transformers 5: a float below 1 is a fraction of the steps
        "lr_scheduler_type": t.lr_scheduler_type,
        "lr_scheduler_kwargs": dict(t.lr_scheduler_kwargs),
        "max_grad_norm": t.max_grad_norm,
        "num_train_epochs": t.num_train_epochs,
        "max_steps": t.max_steps,
        "logging_steps": t.logging_steps,
        "save_steps": t.save_steps,
        "save_total_limit": t.save_total_limit,
        "report_to": t.report_to or "none",
        "seed": t.seed,
        "gradient_checkpointing": t.gradient_checkpointing,
        "deepspeed": t.deepspeed,
        "dataloader_num_workers": t.dataloader_num_workers,
        "eval_strategy": eval_strategy(cfg),
        "eval_steps": t.eval_steps,
        "remove_unused_columns": False,
        # mixed precision autocasts on CPU too (fp32 master weights); a bf16/fp16 model trains as loaded
        "bf16": t.mixed_precision == "bf16" or (cfg.model.dtype == "bfloat16" and not use_cpu),
        "fp16": t.mixed_precision == "fp16" or (cfg.model.dtype == "float16" and not use_cpu),
        "use_cpu": use_cpu,
        "ddp_timeout": int(t.collective_timeout_s),
        "ddp_find_unused_parameters": False,
    }
    if t.metric_for_best_model is not None:
        kwargs["metric_for_best_model"] = hf_metric_name(t.metric_for_best_model)
        kwargs.setdefault("greater_is_better", BEST_MODEL_METRICS.get(t.metric_for_best_model, True))
    return kwargs


def hf_args_problems(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """Names in `training.hf_args` that are unknown, typed elsewhere or controlled by the trainer; numeric and boolean values of the wrong type."""
    hf_args = cfg.training.hf_args
    if not hf_args:
        return []
    fields = training_argument_fields()
    problems: list[ConfigProblem] = []
    for name, value in hf_args.items():
        key = f"{HF_ARGS}.{name}"
        if name in OWNED:
            problems.append(
                ConfigProblem(key, value, f"set by the typed key {OWNED[name]}: set that one instead")
            )
        elif name in CONTROLLED:
            problems.append(
                ConfigProblem(key, value, f"controlled by the trainer: {CONTROLLED[name]}; remove it")
            )
        elif name not in fields:
            close = difflib.get_close_matches(name, list(fields), n=1, cutoff=0.6)
            hint = f"did you mean {HF_ARGS}.{close[0]}?" if close else "see transformers' TrainingArguments"
            problems.append(
                ConfigProblem(key, value, f"not a field of transformers' TrainingArguments; {hint}")
            )
        else:
            mismatch = _type_mismatch(fields[name], value)
            if mismatch:
                problems.append(
                    ConfigProblem(key, value, f"wrong type for TrainingArguments.{name}: {mismatch}")
                )
    return problems


def dry_build_problems(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """`training.hf_args` and the evaluation keys pass transformers' own `TrainingArguments` checks (built at load, on CPU, for one rank)."""
    # `deepspeed` is left out: its post-init needs DeepSpeed and initialises devices (config.sharding checks
    # the file). Configs without hf_args or evaluation skip this, so they never import transformers here.
    t = cfg.training
    if not t.hf_args and eval_strategy(cfg) == "no" and t.metric_for_best_model is None:
        return []
    if hf_args_problems(cfg):
        return []  # reported by name already
    from transformers import TrainingArguments

    kwargs = training_arguments_kwargs(cfg, t.gradient_accumulation(1), use_cpu=True)
    kwargs["deepspeed"] = None
    try:
        TrainingArguments(**kwargs)
    except (ValueError, TypeError, KeyError) as exc:
        return [
            ConfigProblem(HF_ARGS, dict(t.hf_args), f"transformers refuses these TrainingArguments: {exc}")
        ]
    return []


def eval_problems(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """In-training evaluation needs `data.val_jsonl`; `training.metric_for_best_model` names an eval metric and needs evaluation; `hf_args.load_best_model_at_end` or `save_strategy: best` need `metric_for_best_model`."""
    t = cfg.training
    problems: list[ConfigProblem] = []
    evaluating = eval_strategy(cfg) != "no"
    if evaluating and cfg.data.val_jsonl is None:
        problems.append(
            ConfigProblem(
                "data.val_jsonl",
                None,
                f"training.eval_strategy is {eval_strategy(cfg)!r}: set data.val_jsonl to the validation records, "
                "or set training.eval_strategy: no",
            )
        )
    metric = t.metric_for_best_model
    if metric is not None and metric not in BEST_MODEL_METRICS:
        close = difflib.get_close_matches(metric, list(BEST_MODEL_METRICS), n=1, cutoff=0.5)
        hint = f"did you mean {close[0]}? " if close else ""
        problems.append(
            ConfigProblem(
                "training.metric_for_best_model",
                metric,
                f"{hint}not an in-training eval metric; one of {', '.join(BEST_MODEL_METRICS)}",
            )
        )
    if metric is not None and not evaluating:
        problems.append(
            ConfigProblem(
                "training.metric_for_best_model",
                metric,
                "picks the best checkpoint from evaluations, but none run: set training.eval_steps (or eval_strategy)",
            )
        )
    wants_best = bool(t.hf_args.get("load_best_model_at_end")) or t.hf_args.get("save_strategy") == "best"
    if wants_best and metric is None:
        problems.append(
            ConfigProblem(
                "training.metric_for_best_model",
                None,
                "hf_args.load_best_model_at_end / save_strategy: best need the metric that defines 'best': "
                "set training.metric_for_best_model, e.g. eval/f1",
            )
        )
    return problems


def eval_runtime_problems(cfg: RollmatchConfig, *, world_size: int) -> list[ConfigProblem]:
    """Rank 0 evaluates alone, so a colocated engine sharded over ranks (tensor_parallel_size > 1) cannot."""
    vllm = cfg.rollout.vllm
    colocated_tp = (
        cfg.rollout.rollout_backend == "vllm" and vllm.mode == "colocate" and vllm.tensor_parallel_size > 1
    )
    if eval_strategy(cfg) == "no" or world_size == 1 or not colocated_tp:
        return []
    return [
        ConfigProblem(
            "training.eval_strategy",
            eval_strategy(cfg),
            f"rank 0 runs the in-training evaluation alone, but its colocated vLLM engine spans "
            f"{vllm.tensor_parallel_size} ranks: evaluate with rollout servers (vllm.mode: server), "
            "tensor_parallel_size: 1, or after training (`rollmatch eval`)",
        )
    ]


@functools.cache
def training_argument_fields() -> dict[str, Any]:
    """``TrainingArguments`` init fields of the installed transformers -> their resolved annotations."""
    from transformers import TrainingArguments  # rollmatch/__init__ applied the environment workarounds

    try:
        hints = typing.get_type_hints(TrainingArguments)
    except (NameError, TypeError):  # an annotation that does not resolve: check names only
        hints = {}
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(TrainingArguments) if f.init}


def _type_mismatch(annotation: Any, value: Any) -> str | None:
    """pydantic's complaint about ``value`` for a numeric or boolean field (lax: YAML ``1`` is a fine float).

    Only those: transformers annotates some fields narrower than it accepts (``fsdp: str | None`` takes
    ``True``) and checks string and mapping values itself, which the dry build reports.
    """
    from pydantic import TypeAdapter, ValidationError

    members = [a for a in (typing.get_args(annotation) or (annotation,)) if a is not type(None)]
    if not members or not all(member in (int, float, bool) for member in members):
        return None
    try:
        TypeAdapter(annotation).validate_python(value)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        return f"{first['msg']} (expected {annotation})"
    return None
