"""Detection evaluation during training (``training.eval_steps`` / ``training.eval_strategy``).

Owns :class:`DetectionEval`, which HF's loop calls through ``RollmatchTrainer.evaluate`` whenever its eval
strategy says so:

1. **weights** — every rank joins the sync policy's ``push_current_weights`` (a collective, and under
   ZeRO-3 / FSDP a gather every rank takes part in), so the rollout engine serves exactly the weights being
   evaluated — also in async mode with ``sync_every_steps > 1``, where the step loop's last push may be up
   to ``sync_every_steps - 1`` steps old; the step loop's own state (async: the actor's step) is left alone;
2. **evaluate** — rank 0 alone rolls out the validation records (``data.val_jsonl``, the first
   ``eval.max_samples``) with the run's rollout backend, decoding with ``eval.decoding`` (never the
   rollout decoding), and scores them with ``rollmatch.evaluation``
   (the scoring of ``rollmatch eval``), writing ``<output_dir>/eval/step-N.predictions.jsonl``; the other
   ranks wait in a broadcast bounded by ``training.collective_timeout_s``;
3. **agree** — every rank receives the metrics (or rank 0's error, raised everywhere), so HF's
   best-checkpoint bookkeeping (``metric_for_best_model``) is identical on every rank.

Leaves out: the scoring itself (``rollmatch.evaluation``) and when to evaluate, which checkpoint is best
and reloading it (HF's loop, ``training.trainer``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollmatch.collectives import Collectives
from rollmatch.config.hf_args import eval_strategy
from rollmatch.config.resolved import ResolvedRun
from rollmatch.config.schema import RollmatchConfig
from rollmatch.data.prompts import PromptEncoder
from rollmatch.data.records import Record, load_records
from rollmatch.detection.codec import ObjectCodec
from rollmatch.detection.noise_objects import noise_label_of
from rollmatch.errors import BackendError
from rollmatch.evaluation import EvalResult, evaluate
from rollmatch.rollout.types import Decoding, RolloutBackend, SyncReport
from rollmatch.training.step import SyncPolicy

log = logging.getLogger(__name__)
PREFIX = "eval/"


@dataclass
class EvalRound:
    """One evaluation as every rank sees it: the metrics to log and the weight push it needed (if any)."""

    metrics: dict[str, float]
    sync: SyncReport | None


class DetectionEval:
    """Evaluates the model being trained on the validation records (see the module docstring)."""

    def __init__(
        self,
        *,
        cfg: RollmatchConfig,
        decoding: Decoding,
        backend: RolloutBackend,
        sync: SyncPolicy,
        encoder: PromptEncoder,
        codec: ObjectCodec,
        records: Sequence[Record],
        collectives: Collectives,
    ):
        self.cfg = cfg
        self.decoding = decoding  # eval.decoding as resolved (never the rollouts')
        self.backend = backend
        self.sync = sync
        self.encoder = encoder
        self.codec = codec
        self.records = list(records)
        self.collectives = collectives

    def run(self, global_step: int) -> EvalRound:
        """Evaluate the weights after ``global_step`` optimizer steps; every rank returns the same metrics."""
        report = self.sync.push_current_weights(global_step)
        outcome: dict[str, float] | str | None = None
        failure: Exception | None = None
        if self.collectives.is_main:
            try:
                outcome = self._evaluate(global_step)
            except Exception as exc:  # told to every rank below, then raised here unchanged
                failure, outcome = exc, f"{type(exc).__name__}: {exc}"
        outcome = self.collectives.broadcast_object(outcome, f"evaluation at step {global_step}")
        if failure is not None:
            raise failure
        if isinstance(outcome, str) or outcome is None:
            raise BackendError(f"rank 0's evaluation at optimizer step {global_step} failed: {outcome}")
        return EvalRound(metrics=outcome, sync=report)

    def _evaluate(self, global_step: int) -> dict[str, float]:
        out_dir = os.path.join(self.cfg.training.output_dir, "eval")
        result = evaluate(
            self.backend,
            self.encoder,
            self.codec,
            self.records,
            decoding=self.decoding,
            matching=self.cfg.eval.matching,
            batch_size=self.cfg.eval.batch_size,
            count_buckets=self.cfg.eval.count_buckets,
            predictions_path=os.path.join(out_dir, f"step-{global_step}.predictions.jsonl"),
            seed=self.cfg.training.seed,
            progress=False,
            noise_label=noise_label_of(self.cfg),
        )
        metrics = eval_metrics(result, weight_version=self.backend.weight_version)
        log.info(
            "evaluation at step %d (decoding %s): %s",
            global_step,
            result.decoding,
            {k: round(v, 4) for k, v in metrics.items()},
        )
        return metrics


def eval_metrics(result: EvalResult, *, weight_version: int) -> dict[str, float]:
    """The logged ``eval/*`` metrics of one evaluation (names in docs/metrics.md)."""
    metrics = {
        f"{PREFIX}{name}": float(getattr(result, name))
        for name in (
            "precision",
            "recall",
            "f1",
            "mean_iou",
            "map",
            "map_50",
            "map_75",
            "map_position_scored",
            "map_50_position_scored",
            "map_75_position_scored",
            "map_uniform_score",
            "map_50_uniform_score",
            "map_75_uniform_score",
            "count_error",
            "count_mae",
            "recall_first_third",
            "recall_middle_third",
            "recall_last_third",
            "kendall_tau",
            "truncated_frac",
            "objects_per_image",
            "fp_per_image",
            "exact_count_acc",
            "duplicate_rate",
            "duplicate_rate_any_label",
        )
    }
    metrics.update({f"{PREFIX}recall_gt_{n}": value for n, value in result.recall_by_gt_count.items()})
    for bucket, values in result.gt_count_buckets.items():
        metrics.update({f"{PREFIX}gt_count_{bucket}/{name}": float(v) for name, v in values.items()})
    if result.noise_label is not None:  # a model trained with loss.noise_objects
        metrics[f"{PREFIX}noise_objects_per_image"] = float(result.noise_objects_per_image)
    metrics[f"{PREFIX}samples"] = float(result.num_samples)
    metrics[f"{PREFIX}seconds"] = float(result.seconds)
    metrics[f"{PREFIX}weight_version"] = float(weight_version)
    for reason, count in result.invalid.items():
        metrics[f"{PREFIX}invalid_{reason}"] = float(count)
    return metrics


def build_detection_eval(
    run: ResolvedRun,
    *,
    backend: RolloutBackend,
    sync: SyncPolicy,
    encoder: PromptEncoder,
    codec: ObjectCodec,
    collectives: Collectives,
) -> DetectionEval | None:
    """The in-training evaluation of ``run`` (None when ``training.eval_strategy`` resolves to ``no``)."""
    cfg = run.config
    if eval_strategy(cfg) == "no":
        return None
    assert cfg.data.val_jsonl is not None  # config.hf_args.eval_problems refuses evaluation without it
    records = load_records(cfg.data.val_jsonl, max_samples=cfg.eval.max_samples)
    return DetectionEval(
        cfg=cfg,
        decoding=run.eval_decoding,
        backend=backend,
        sync=sync,
        encoder=encoder,
        codec=codec,
        records=records,
        collectives=collectives,
    )


def hf_metrics(metrics: dict[str, Any], prefix: str = "eval") -> dict[str, float]:
    """``eval/f1`` -> ``eval_f1``: the keys HF's ``evaluate()`` returns (``metric_for_best_model`` reads them)."""
    return {f"{prefix}_{name.removeprefix(PREFIX)}": float(value) for name, value in metrics.items()}
