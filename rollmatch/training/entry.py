"""``rollmatch train``: build -> setup -> run -> cleanup, top to bottom.

Owns: mapping the config onto HF ``TrainingArguments``, loading the model (optionally with LoRA),
assembling the variant, resuming, and saving a final model directory that ``rollmatch eval`` and
rollout servers can load. Works the same under ``torchrun`` (DDP over gloo/NCCL) and alone.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import TrainingArguments, set_seed

from rollmatch.collectives import build_collectives, exit_hard_on_fatal_distributed_error, init_default_group
from rollmatch.config.load import load_config
from rollmatch.config.rules import check_runtime
from rollmatch.config.schema import RollmatchConfig
from rollmatch.data.prompts import PromptEncoder
from rollmatch.data.records import load_records
from rollmatch.detection.codec import build_codec
from rollmatch.errors import ConfigError
from rollmatch.models.pretrained import load_pretrained
from rollmatch.packing.collate import enable_packed_attention
from rollmatch.training.metrics import JsonlMetricsCallback, summarize
from rollmatch.training.sizing import check_row_sizing
from rollmatch.training.trainer import (
    RecordDataset,
    RollmatchTrainer,
    keep_records,
    latest_complete_checkpoint,
)
from rollmatch.training.variants import BuildContext, build_variant

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    output_dir: str
    final_model_dir: str
    global_step: int
    seconds: float
    log_history: list[dict[str, Any]]


def train_command(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config, args.overrides)
    with exit_hard_on_fatal_distributed_error():  # a hung peer must not hang this rank's teardown
        result = run_training(cfg)
    print(
        f"trained {result.global_step} steps in {result.seconds:.1f}s; final model: {result.final_model_dir}"
    )
    return 0


def run_training(cfg: RollmatchConfig) -> TrainResult:
    """Train one variant end to end; returns where the results are."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    problems = check_runtime(
        cfg, world_size=world_size, device_count=torch.cuda.device_count(), device_type=device_type
    )
    if problems:
        raise ConfigError(problems)
    gas = cfg.training.gradient_accumulation(world_size)
    init_default_group(cfg.training.collective_timeout_s)  # before HF, which would ignore the timeout
    args = training_arguments(cfg, gas, use_cpu=device_type == "cpu")
    set_seed(cfg.training.seed)
    collectives = build_collectives(cfg.training.collective_timeout_s)

    encoder = PromptEncoder.from_pretrained(cfg.model.path, cfg.data)
    model = load_model(cfg)
    codec = build_codec(cfg.custom.object_format, encoder.tokenizer, [encoder.eos_token_id])
    records = load_records(cfg.data.train_jsonl, max_samples=cfg.data.max_samples)
    check_row_sizing(cfg, records, encoder, codec)
    holder: dict[str, Any] = {}
    ctx = BuildContext(
        cfg=cfg,
        model=model,
        encoder=encoder,
        codec=codec,
        collectives=collectives,
        gradient_accumulation_steps=gas,
        train_records=records,
        optimizer_getter=lambda: getattr(holder.get("trainer"), "optimizer", None),
    )
    parts = build_variant(ctx)
    start = time.perf_counter()
    try:
        trainer = RollmatchTrainer(
            model=model,
            args=args,
            train_dataset=RecordDataset(records),
            data_collator=keep_records,
            planner=parts.planner,
            stateful=parts.stateful,
            summarize=summarize,
            collectives=collectives,
            callbacks=[JsonlMetricsCallback(os.path.join(cfg.training.output_dir, "metrics.jsonl"))],
        )
        holder["trainer"] = trainer
        resume = resolve_resume(cfg)
        if resume is not None:
            trainer.load_rank_state(resume)
        trainer.train(resume_from_checkpoint=resume)
        final_dir = save_final_model(trainer, encoder, cfg)
    finally:
        parts.close()  # async actors stop before the weight-sync groups close
    return TrainResult(
        output_dir=cfg.training.output_dir,
        final_model_dir=final_dir,
        global_step=trainer.state.global_step,
        seconds=time.perf_counter() - start,
        log_history=list(trainer.state.log_history),
    )


def training_arguments(cfg: RollmatchConfig, gas: int, *, use_cpu: bool) -> TrainingArguments:
    t = cfg.training
    return TrainingArguments(
        output_dir=t.output_dir,
        per_device_train_batch_size=t.per_device_train_batch_size,
        gradient_accumulation_steps=gas,
        learning_rate=t.learning_rate,
        weight_decay=t.weight_decay,
        warmup_steps=t.warmup_ratio,
        lr_scheduler_type=t.lr_scheduler_type,
        max_grad_norm=t.max_grad_norm,
        num_train_epochs=t.num_train_epochs,
        max_steps=t.max_steps,
        logging_steps=t.logging_steps,
        save_strategy="steps",
        save_steps=t.save_steps,
        save_total_limit=t.save_total_limit,
        report_to=t.report_to or "none",
        seed=t.seed,
        gradient_checkpointing=t.gradient_checkpointing,
        deepspeed=t.deepspeed,
        dataloader_num_workers=t.dataloader_num_workers,
        remove_unused_columns=False,
        bf16=cfg.model.dtype == "bfloat16" and not use_cpu,
        fp16=cfg.model.dtype == "float16" and not use_cpu,
        use_cpu=use_cpu,
        ddp_timeout=int(t.collective_timeout_s),
        ddp_find_unused_parameters=False,
        disable_tqdm=False,
    )


def load_model(cfg: RollmatchConfig) -> torch.nn.Module:
    """The trainable model: HF weights in the configured dtype, with LoRA/DoRA adapters if enabled."""
    model = load_pretrained(cfg)
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


def resolve_resume(cfg: RollmatchConfig) -> str | None:
    """``latest`` -> newest complete checkpoint (None if there is none); a path must exist."""
    spec = cfg.training.resume_from_checkpoint
    if spec is None:
        return None
    if spec == "latest":
        return latest_complete_checkpoint(cfg.training.output_dir)
    if not Path(spec).is_dir():
        from rollmatch.errors import ConfigProblem

        raise ConfigError(
            [
                ConfigProblem(
                    "training.resume_from_checkpoint", spec, "no such checkpoint directory; use `latest`"
                )
            ]
        )
    return spec


def save_final_model(trainer: RollmatchTrainer, encoder: PromptEncoder, cfg: RollmatchConfig) -> str:
    """Save a loadable model dir (LoRA merged) with its processor under ``<output_dir>/final``."""
    final_dir = os.path.join(cfg.training.output_dir, "final")
    model = trainer.accelerator.unwrap_model(trainer.model)
    if trainer.args.should_save:
        if hasattr(model, "merge_and_unload"):
            import copy

            model = copy.deepcopy(model).merge_and_unload()
        model.save_pretrained(final_dir)
        encoder.processor.save_pretrained(final_dir)
    trainer.accelerator.wait_for_everyone()
    return final_dir
