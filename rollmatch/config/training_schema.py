"""The ``training``, ``preflight`` and ``eval`` sections of the schema: optimisation and batching (mapped
onto HF ``TrainingArguments``), the start model's check, in-training and stand-alone evaluation.

Owns the pydantic models and :data:`DEFAULT_COUNT_BUCKETS`; every key's default and description lives
here once. Leaves out: the mapping onto ``TrainingArguments`` and its rules (``config.hf_args``).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Literal

from pydantic import Field, field_validator

from rollmatch.config.loss_schema import MatchingConfig
from rollmatch.config.rollout_schema import DecodingConfig
from rollmatch.config.section import Section


# ------------------------------------------------------------------------------------------ training
class TrainingConfig(Section):
    """Optimisation and batching; maps onto HF TrainingArguments."""

    output_dir: str = Field("runs/demo/train", description="Checkpoints, logs, TensorBoard.")
    per_device_train_batch_size: int = Field(1, gt=0, description="Samples per device per micro-step.")
    gradient_accumulation_steps: int = Field(
        1, gt=0, description="Micro-steps per optimizer step (ignored if effective_batch_size is set)."
    )
    effective_batch_size: int | None = Field(
        None, gt=0, description="If set: gradient_accumulation_steps = ceil(eff / (bs * world))."
    )
    packing: bool = Field(False, description="Pack segments into padding-free rows after rollouts.")
    global_max_length: int = Field(2048, gt=0, description="Max tokens of one sample; packing_length.")
    carry_buffer_size: int = Field(
        64, gt=0, description="Packing: max segments waiting for a row (per rank)."
    )
    seed: int = Field(42, description="Seed of initialisation, data order and rollout sampling.")
    learning_rate: float = Field(1e-5, gt=0.0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    warmup_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Fraction of steps with linear LR warmup.")
    lr_scheduler_type: str = Field("constant", description="HF scheduler name: constant, linear, cosine, ...")
    lr_scheduler_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra arguments of the scheduler, e.g. `{num_decay_steps: 200}` for `warmup_stable_decay` (a cool-down over the last 200 steps).",
    )
    max_grad_norm: float = Field(1.0, ge=0.0, description="Gradient clipping norm (0: off).")
    num_train_epochs: float = Field(1.0, gt=0.0, description="Epochs over train_jsonl (when max_steps <= 0).")
    max_steps: int = Field(-1, ge=-1, description="> 0 overrides num_train_epochs; -1: use the epochs.")
    logging_steps: int = Field(
        10,
        gt=0,
        description="Log metrics every N optimizer steps: one short line on the console (loss, lr, grad_norm, "
        "f1, ...), every metric to <output_dir>/metrics.jsonl and TensorBoard (docs/metrics.md).",
    )
    log_rollouts_every: int = Field(
        50,
        ge=0,
        description="Rank 0 logs `log_rollouts_count` of the rollouts an optimizer step trains on, at the first "
        "step that trains rollouts and then at every N-th step (a due step that trains none passes it on): a "
        "picture each (GT / matched / false positive / missed boxes, the parse failure) to TensorBoard and W&B "
        "when in `report_to`, and <output_dir>/rollouts/step-N.jsonl (raw rollouts, parse, match, target "
        "summary) with step-N/*.png beside it. 0: off. About 0.06 s of CPU per logged rollout (docs/runbook.md).",
    )
    log_rollouts_count: int = Field(
        4, gt=0, description="Rollouts logged per logged step (`log_rollouts_every`), other records first."
    )
    save_steps: int = Field(500, gt=0, description="Checkpoint every N optimizer steps.")
    save_total_limit: int | None = Field(2, gt=0, description="Keep at most N checkpoints (null: all).")
    report_to: list[str] = Field(
        default_factory=lambda: ["tensorboard"],
        description="HF logging integrations, a list or one name as HF takes it (`wandb`); [] or `none` for none.",
    )
    mixed_precision: Literal["no", "bf16", "fp16"] = Field(
        "no",
        description="Compute (autocast) dtype while the weights and optimizer state stay in model.dtype (which "
        "must then be float32): HF `bf16`/`fp16`; under DeepSpeed its bf16 mode, which keeps fp32 master "
        "weights. Rollout engines then run in this dtype (vLLM `--dtype`). `no`: compute in model.dtype.",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward to save memory."
    )
    freeze: list[Literal["vision_tower", "merger", "language_model"]] = Field(
        default_factory=list,
        description="Module groups that are not trained: `vision_tower` (`model.visual.*` but its mergers), "
        "`merger` (`model.visual.*merger*`: the patch merger and Qwen3-VL's deepstack mergers), `language_model` "
        "(everything outside `model.visual`, with the embeddings and `lm_head`). Frozen weights are sent to rollout "
        "engines once, then left out of weight syncs. Not with `model.lora.enabled`.",
    )
    lr_multipliers: dict[Literal["vision_tower", "merger", "language_model"], float] = Field(
        default_factory=dict,
        description="Per module group (as in `freeze`): its learning rate is `learning_rate` x this, through "
        "warmup and decay, e.g. `{vision_tower: 0.1}`; a group not listed gets 1. Not with `model.lora.enabled`.",
    )
    resume_from_checkpoint: str | None = Field(
        "auto",
        description="Where training starts. `auto`: from the newest complete checkpoint under `output_dir` when "
        "there is one, else step 0 (a resubmitted, requeued or rerun job goes on; with `overwrite_output_dir: "
        "true`, step 0). `latest`: the same, also under `overwrite_output_dir`. A checkpoint dir: that one (it "
        "must be complete). null: step 0, refused over complete checkpoints unless `overwrite_output_dir`. "
        "Checkpoints that exist but none complete, or saved by another world size, are refused.",
    )
    overwrite_output_dir: bool = Field(
        False,
        description="Start at step 0 although `output_dir` holds complete checkpoints of an earlier run (with "
        "`resume_from_checkpoint` `auto` or null); `save_total_limit` then deletes them as new ones are saved. "
        "Applies to every start of that config, a resubmitted job's included: remove it once the new run saved "
        "its first checkpoint.",
    )
    deepspeed: str | None = Field(None, description="DeepSpeed JSON config path (HF Trainer integration).")
    dataloader_num_workers: int = Field(0, ge=0, description="DataLoader worker processes (0: main process).")
    collective_timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="Timeout of every cross-rank wait. Waits other ranks sit out in a collective leave it a margin (a tenth, at least 10 s): `stage2_ab.channel_b.async.max_wait_s` and, with several ranks, `vllm.server.timeout_s` (the first push's group init).",
    )
    eval_strategy: Literal["no", "steps", "epoch"] | None = Field(
        None,
        description="Detection eval on data.val_jsonl during training (docs/runbook.md); null: `steps` if "
        "eval_steps is set, else `no`.",
    )
    eval_steps: int | None = Field(
        None, gt=0, description="Evaluate every N optimizer steps (eval_strategy steps; null: logging_steps)."
    )
    metric_for_best_model: str | None = Field(
        None,
        description="Eval metric that picks the best checkpoint (HF's metric_for_best_model): eval/f1, "
        "eval/precision, eval/recall, eval/mean_iou, eval/map, eval/map_50, eval/map_75 (higher is better) or "
        "eval/truncated_frac (lower). With hf_args.load_best_model_at_end the final model is the best one.",
    )
    hf_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Any other HF TrainingArguments field, passed through as written, e.g. {optim: adamw_torch, "
        "adam_beta2: 0.95, run_name: x, torch_compile: false, save_strategy: steps, load_best_model_at_end: "
        "true}. Checked at load against the installed transformers (unknown names, types, its own rules); "
        "fields set by a typed key or by the trainer are refused with the reason (docs/runbook.md).",
    )

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_integration_as_a_list(cls, value: Any) -> Any:
        """HF takes one name as a string (`report_to: wandb`); `none` is HF's spelling of []."""
        if isinstance(value, str):
            return [] if value == "none" else [value]
        return value

    def gradient_accumulation(self, world_size: int) -> int:
        """GAS in force: derived from ``effective_batch_size`` when set (a ceiling)."""
        if self.effective_batch_size is None:
            return self.gradient_accumulation_steps
        return max(1, math.ceil(self.effective_batch_size / (self.per_device_train_batch_size * world_size)))


# Lower edges of the GT-count buckets of the per-bucket metrics (eval.count_buckets): 1-3, 4-7, 8-12,
# 13-19, 20-25, 26-30, 31+, suited to 1-30 objects per image.
DEFAULT_COUNT_BUCKETS: tuple[int, ...] = (1, 4, 8, 13, 20, 26, 31)


class PreflightConfig(Section):
    """The check before rollout training (`rollmatch preflight`, docs/runbook.md "Preflight")."""

    records: int = Field(
        16,
        ge=0,
        description="Training records rank 0 rolls out with the start model before a rollout-training run (any variant but `sft`) trains; 0 skips the check. 16 greedy rollouts take seconds on a GPU and tell a model that answers in the format from one that does not.",
    )
    min_valid_fraction: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="The run stops, with the report, when fewer of those rollouts than this are valid (a closed list, every element valid with a known label, not truncated, the record fits the length budget). 0.5: below half, Channel-B's targets are mostly the GT appended to a bare `[` and GRPO's rewards mostly the floor, so rollout training spends its compute on what stage-1 SFT does cheaper; a stage-1 model answers nearly all in the format. Lower it (0 disables the stop) to train anyway.",
    )


class EvalConfig(Section):
    """Evaluation rollouts (`rollmatch eval` and end-of-training evaluation)."""

    max_new_tokens: int | None = Field(None, gt=0, description="Default: rollout_matching.max_new_tokens.")
    batch_size: int = Field(8, gt=0, description="Samples per rollout call during evaluation.")
    max_samples: int | None = Field(None, gt=0, description="Evaluate only the first N records (null: all).")
    decoding: DecodingConfig = Field(
        default_factory=DecodingConfig,
        description="How evaluation decodes (default greedy): its own settings, never "
        "custom.extra.rollout_matching.decoding, so runs that sample their rollouts are scored alike; the "
        "eval JSON records it. Sampled: request i of a call is seeded training.seed + batch offset + i.",
    )
    count_buckets: list[int] = Field(
        default_factory=lambda: list(DEFAULT_COUNT_BUCKETS),
        description="Lower edges of the GT-count buckets of the per-bucket precision / recall / F1 (eval JSON "
        "`gt_count_buckets`, `eval/gt_count_<bucket>/*`, and the rollouts' `match/gt_count_<bucket>/*`): "
        "[1, 4, 8, 13, 20, 26, 31] gives 1-3, 4-7, 8-12, 13-19, 20-25, 26-30, 31+. Strictly increasing, >= 0; "
        "images below the first edge form a bucket of their own.",
    )
    noise_label: str | None = Field(
        None,
        min_length=1,
        description="Answers' objects with this label are dropped before matching and scoring (they are the noise objects of a model trained with `loss.noise_objects`) and counted as `noise_objects_per_image`. null: `loss.noise_objects.label` when `loss.noise_objects.enabled`, else none is dropped. A run's checkpoints record it in rollmatch_run.json, so `rollmatch eval --model CHECKPOINT` drops them too.",
    )
    matching: MatchingConfig = Field(
        default_factory=MatchingConfig,
        description="How evaluation matches predictions to GT (its own section, so runs trained with other `matching.*` settings are scored alike; every report states it).",
    )

    @field_validator("count_buckets")
    @classmethod
    def _increasing_edges(cls, edges: list[int]) -> list[int]:
        if not edges or edges[0] < 0 or any(b <= a for a, b in itertools.pairwise(edges)):
            raise ValueError(
                f"eval.count_buckets = {edges}: give the buckets' lower edges, non-empty, >= 0 and strictly "
                "increasing, e.g. [1, 4, 8, 13, 20, 26, 31]"
            )
        return edges
