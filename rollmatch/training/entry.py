"""``rollmatch train``: build -> setup -> run -> cleanup, top to bottom.

Owns: mapping the config onto HF ``TrainingArguments``, loading the model (optionally with LoRA),
assembling the variant, resuming, and saving a final model directory that ``rollmatch eval`` and
rollout servers can load. Works the same under ``torchrun`` (DDP over gloo/NCCL) and alone.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainingArguments, set_seed

from rollmatch.collectives import (
    Collectives,
    build_collectives,
    exit_hard_on_fatal_distributed_error,
    init_default_group,
)
from rollmatch.config.hf_args import eval_strategy, training_arguments_kwargs
from rollmatch.config.input_files import input_file_problems
from rollmatch.config.load import load_config, resolve_checked_run
from rollmatch.config.resolved import ResolvedRun, this_launch
from rollmatch.config.run_file import RUN_FILE, changed_settings, read_run_file, run_settings, write_run_file
from rollmatch.config.schema import LossConfig, RollmatchConfig
from rollmatch.data.labels import prompt_labels
from rollmatch.data.prompts import PromptEncoder, load_processor
from rollmatch.data.record_lengths import fitting_records
from rollmatch.data.records import load_records
from rollmatch.detection.coord_tokens import coord_token_ids, supported_object_formats
from rollmatch.detection.object_formats import build_codec
from rollmatch.errors import ConfigError
from rollmatch.models.pretrained import load_pretrained
from rollmatch.packing.collate import enable_packed_attention
from rollmatch.training.checkpoints import CHECKPOINT_PREFIX, ConfiguredIntervals
from rollmatch.training.coord_loss import CoordLoss
from rollmatch.training.grpo_loss import grpo_settings
from rollmatch.training.metric_summary import JsonlMetricsCallback, summarize
from rollmatch.training.param_groups import freeze_groups
from rollmatch.training.periodic_eval import DetectionEval, build_detection_eval
from rollmatch.training.preemption import (
    CheckpointOnWarning,
    ignore_warning_signal,
    install_warning_handler,
)
from rollmatch.training.rollout_log import RolloutLog
from rollmatch.training.step import SyncBeforeRollouts
from rollmatch.training.trainer import RecordDataset, RollmatchTrainer, keep_records
from rollmatch.training.variants import BuildContext, VariantParts, backend_for, build_variant

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    output_dir: str
    final_model_dir: str | None  # None: stopped on the warning signal (a checkpoint, no final model)
    global_step: int
    seconds: float
    log_history: list[dict[str, Any]]
    stopped_before_training: bool = False  # the warning came while the run was starting


def train_command(args: argparse.Namespace) -> int:
    install_warning_handler()  # from the first second: a warning while loading stops the run cleanly
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config, args.overrides)
    try:
        with exit_hard_on_fatal_distributed_error():  # a hung peer must not hang this rank's teardown
            result = run_training(cfg)
    finally:
        ignore_warning_signal()  # a forward arriving while the process exits must not kill it
    if result.final_model_dir is None and result.stopped_before_training:
        print(
            f"stopped on the warning signal (SIGUSR1) before training (step {result.global_step}): nothing "
            f"new to save under {result.output_dir}; rerun to resume (training.resume_from_checkpoint: auto)"
        )
        return 0
    if result.final_model_dir is None:
        print(
            f"stopped on the warning signal (SIGUSR1) after step {result.global_step}: checkpoint-"
            f"{result.global_step} saved under {result.output_dir}; rerun to resume (training.resume_from_checkpoint: auto)"
        )
        return 0
    print(
        f"trained {result.global_step} steps in {result.seconds:.1f}s; final model: {result.final_model_dir}"
    )
    return 0


def checkpoint_step(checkpoint: str | None) -> int:
    """The optimizer step a ``checkpoint-N`` folder was saved at (0: no checkpoint)."""
    if checkpoint is None:
        return 0
    return int(os.path.basename(os.path.normpath(checkpoint)).removeprefix(CHECKPOINT_PREFIX))


def coord_loss_for(loss: LossConfig, codec: Any) -> CoordLoss | None:
    """The coordinate loss of ``coord_tokens`` targets (None for digit coordinates)."""
    ids = getattr(codec, "coord_ids", None)
    return CoordLoss.from_config(ids, loss) if ids is not None else None


def run_training(cfg: RollmatchConfig) -> TrainResult:
    """Train one variant end to end; returns where the results are."""
    install_warning_handler()  # API callers too (a no-op off the main thread)
    launch = this_launch()
    world_size, device_type = launch.world_size, launch.device_type
    # What check-config refuses, refused here through the same door, every problem at once: missing
    # inputs, an unusable checkpoint and every rule of the config (resolve_checked_run raises with all).
    run, resume = resolve_checked_run(
        cfg, launch, resume_world_size=world_size, input_checks=input_file_problems
    )
    gas = run.gradient_accumulation_steps
    init_default_group(cfg.training.collective_timeout_s)  # before HF, which would ignore the timeout
    args = training_arguments(cfg, gas, use_cpu=device_type == "cpu")
    set_seed(cfg.training.seed)
    collectives = build_collectives(cfg.training.collective_timeout_s)

    encoder = PromptEncoder(
        load_processor(run.model_dir, *run.pixel_bounds),
        cfg.data.prompt,
        run.frame,
        prompt_labels(cfg.data, cfg.training.seed),
    )
    log.info("coordinate frame: %s (data.coord_frame: %s)", run.coord_frame, cfg.data.coord_frame)
    codec = build_codec(cfg.custom.object_format, encoder.tokenizer, [encoder.eos_token_id])
    settings = saved_run_settings(run, encoder, codec)
    if resume is not None:
        check_resume_settings(resume, settings)
    warn_start_model_settings(cfg.model.path, settings)
    # Every record's length against a row, before the model loads (data.over_length: error | drop).
    records = fitting_records(
        cfg, load_records(cfg.data.train_jsonl, max_samples=cfg.data.max_samples), encoder, codec
    )
    model = load_model(cfg)
    holder: dict[str, Any] = {}
    rollout_log = rollout_log_for(cfg, encoder, codec, collectives)
    ctx = BuildContext(
        run=run,
        model=model,
        encoder=encoder,
        codec=codec,
        collectives=collectives,
        train_records=records,
        optimizer_getter=lambda: getattr(holder.get("trainer"), "optimizer", None),
        rollout_log=rollout_log,
    )
    parts = build_variant(ctx)
    start = time.perf_counter()
    warning = CheckpointOnWarning(
        collectives,
        # the warning's lead only matters where a scheduler sends it before a time limit
        signal_warning_s=cfg.launch.slurm.signal_warning_s if "SLURM_JOB_ID" in os.environ else None,
        max_wait_s=cfg.stage2_ab.channel_b.async_.max_wait_s
        if cfg.stage2_ab.channel_b.mode == "async"
        else 0.0,
    )
    try:
        detection_eval = eval_for_variant(ctx, parts)
        trainer = RollmatchTrainer(
            model=model,
            args=args,
            train_dataset=RecordDataset(records),
            eval_dataset=RecordDataset(detection_eval.records) if detection_eval is not None else None,
            data_collator=keep_records,
            planner=parts.planner,
            stateful=parts.stateful,
            detection_eval=detection_eval,
            summarize=functools.partial(summarize, count_buckets=cfg.eval.count_buckets),
            collectives=collectives,
            coord_loss=coord_loss_for(cfg.loss, codec),
            grpo=grpo_settings(cfg) if cfg.loss.objective == "grpo" else None,
            lr_multipliers=cfg.training.lr_multipliers,
            run_settings=settings,
            processing_class=encoder.processor,  # HF saves it into every checkpoint-N
            callbacks=[
                JsonlMetricsCallback(os.path.join(cfg.training.output_dir, "metrics.jsonl")),
                warning,
                ConfiguredIntervals(),
            ],
        )
        holder["trainer"] = trainer
        if cfg.custom.trainer_variant != "sft" and cfg.preflight.records > 0 and resume is None:
            from rollmatch.training.preflight import preflight_before_training

            preflight_before_training(ctx, records)  # after the Trainer placed the model on its device
        if rollout_log is not None:  # its pictures go through HF's TensorBoard writer
            rollout_log.writers = lambda: trainer.callback_handler.callbacks
        if resume is not None:
            trainer.load_rank_state(resume)
        warning.install()
        if warning.stop_before_training(checkpoint_step(resume)):
            return TrainResult(
                output_dir=cfg.training.output_dir,
                final_model_dir=None,
                global_step=checkpoint_step(resume),
                seconds=time.perf_counter() - start,
                log_history=[],
                stopped_before_training=True,
            )
        trainer.train(resume_from_checkpoint=resume)
        warning.uninstall()
        stopped = warning.stopped_at_step is not None
        final_dir = None if stopped else save_final_model(trainer, encoder, cfg, settings)
    finally:
        warning.uninstall()
        parts.close()  # async actors stop before the weight-sync groups close
    return TrainResult(
        output_dir=cfg.training.output_dir,
        final_model_dir=final_dir,
        global_step=trainer.state.global_step,
        seconds=time.perf_counter() - start,
        log_history=list(trainer.state.log_history),
    )


def rollout_log_for(
    cfg: RollmatchConfig, encoder: PromptEncoder, codec: Any, collectives: Collectives
) -> RolloutLog | None:
    """Rank 0's rollout log (``training.log_rollouts_every``); None when off or nothing is rolled out."""
    if cfg.training.log_rollouts_every <= 0 or cfg.custom.trainer_variant == "sft" or not collectives.is_main:
        return None
    return RolloutLog(cfg, encoder, codec)


def eval_for_variant(ctx: BuildContext, parts: VariantParts) -> DetectionEval | None:
    """In-training evaluation on the variant's rollout backend and sync policy (``sft``: built for it)."""
    if eval_strategy(ctx.cfg) == "no":
        return None
    if parts.backend is None:  # sft rolls nothing out while training: evaluation brings its own backend
        parts.backend = backend_for(ctx)
    sync = (
        parts.planner.sync if parts.planner.sync is not None else SyncBeforeRollouts(parts.backend, ctx.model)
    )
    return build_detection_eval(
        ctx.run,
        backend=parts.backend,
        sync=sync,
        encoder=ctx.encoder,
        codec=ctx.codec,
        collectives=ctx.collectives,
    )


def training_arguments(cfg: RollmatchConfig, gas: int, *, use_cpu: bool) -> TrainingArguments:
    """HF ``TrainingArguments`` from typed keys, trainer-controlled fields and ``training.hf_args``."""
    return TrainingArguments(**training_arguments_kwargs(cfg, gas, use_cpu=use_cpu))


def load_model(cfg: RollmatchConfig) -> torch.nn.Module:
    """The trainable model: HF weights in the configured dtype, with LoRA/DoRA adapters if enabled."""
    model = load_pretrained(cfg)
    if cfg.training.freeze:
        frozen = freeze_groups(model, cfg.training.freeze)
        log.info(
            "frozen (training.freeze): %s", ", ".join(f"{g} {n:,} parameters" for g, n in frozen.items())
        )
    if cfg.training.packing:
        # Packed rows attend per segment (causal sdpa per segment, like flash-attention's varlen
        # path) instead of one full masked LxL attention; exact either way, several times faster.
        enable_packed_attention(model)
    lora = cfg.model.lora
    if not lora.enabled:
        return model
    from peft import LoraConfig, get_peft_model

    # Adapters only on the language model: the vision tower keeps its pretrained features.
    targets = "|".join(lora.target_modules)
    return get_peft_model(
        model,
        LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            use_dora=lora.use_dora,
            target_modules=rf".*language_model.*\.({targets})",
        ),
    )


def saved_run_settings(run: ResolvedRun, encoder: PromptEncoder, codec: Any) -> dict[str, Any]:
    """The ``rollmatch_run.json`` of this run's checkpoints and ``final/`` (``config.run_file``)."""
    formats = supported_object_formats(encoder.tokenizer)
    return run_settings(
        run,
        labels=list(encoder.labels.names) if encoder.labels is not None else None,
        pixel_bounds=encoder.pixel_bounds,
        coord_token_ids=coord_token_ids(encoder.tokenizer) if "coord_tokens" in formats else None,
    )


def check_resume_settings(checkpoint: str, settings: dict[str, Any]) -> None:
    """Refuse to resume ``checkpoint`` with other answer settings than it was trained with."""
    saved = read_run_file(checkpoint)
    if saved is None:
        log.warning("resuming %s, which holds no %s: its settings cannot be checked", checkpoint, RUN_FILE)
        return
    if problems := changed_settings(saved, settings):
        raise ConfigError(problems)


def warn_start_model_settings(model_dir: str, settings: dict[str, Any]) -> None:
    """A start model trained by rollmatch (stage-1's ``final/``) with other answer settings than this run
    (another prompt, class list, frame, format) is usually a config mistake: say which, once each."""
    saved = read_run_file(model_dir)
    for problem in changed_settings(saved, settings) if saved is not None else []:
        log.warning(
            "%s = %r here, but the start model %s was trained with %r (its %s)",
            problem.key,
            problem.value,
            model_dir,
            saved["settings"].get(problem.key),
            RUN_FILE,
        )


def save_final_model(
    trainer: RollmatchTrainer, encoder: PromptEncoder, cfg: RollmatchConfig, settings: dict[str, Any]
) -> str:
    """Save a loadable model dir (LoRA merged) with its processor and run settings under
    ``<output_dir>/final``."""
    final_dir = os.path.join(cfg.training.output_dir, "final")
    model = trainer.accelerator.unwrap_model(trainer.model)
    if trainer.args.should_save:
        if hasattr(model, "merge_and_unload"):
            import copy

            model = copy.deepcopy(model).merge_and_unload()
        model.save_pretrained(final_dir)
        encoder.processor.save_pretrained(final_dir)
        write_run_file(final_dir, settings)
    trainer.accelerator.wait_for_everyone()
    return final_dir
