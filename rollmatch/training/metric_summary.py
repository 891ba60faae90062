"""Training metrics: additive sums -> the metric names of docs/metrics.md, and a JSONL sink.

Producers (channels, row builder, window) emit *sums* (counts, token totals, seconds), which are
summed exactly over micro-steps and ranks; only here are they turned into means, rates and F1,
over all optimizer steps since the last log line. Parse and matching counts go through the one
metrics path of ``detection`` (``ScoreCounts.from_sums``), so training, evaluation and the benches
compute precision / recall / F1 alike (empty case included).

:func:`summarize` runs one function per metric family (:data:`METRIC_FAMILIES`); a new family is a
new ``(sums, steps) -> {name: value}`` function added to that tuple. The per-GT-count-bucket rollout
metrics also need the bucket edges, which :func:`summarize` takes as a keyword.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from transformers import TrainerCallback

from rollmatch.detection.count_metrics import DEFAULT_COUNT_BUCKETS, CountOrderCounts
from rollmatch.detection.scoring import ScoreCounts
from rollmatch.training.grpo_loss import ratio_quantiles

Sums = Mapping[str, float]
# Counts of the rollout-matching targets built from the rollouts (training.segment_producers), per step.
TARGET_SUMS = (
    "target/dropped_elements",
    "target/over_max_new_tokens",
    "target/differs_from_sft",
    "target/unlikelihood_tokens",
)


def summarize(
    sums: Sums, steps: int, *, count_buckets: Sequence[int] = DEFAULT_COUNT_BUCKETS
) -> dict[str, float]:
    """Metric values of ``steps`` optimizer steps from their aggregated sums; the rollouts' per-GT-count
    metrics use ``count_buckets`` (lower edges; the trainer passes ``eval.count_buckets``)."""
    out: dict[str, float] = {}
    for family in METRIC_FAMILIES:
        out.update(family(sums, steps))
    out.update(count_bucket_metrics(sums, steps, count_buckets))
    return out


def rollout_metrics(sums: Sums, steps: int) -> dict[str, float]:
    """``rollout/*``, ``parse/*``, ``match/*`` and ``target/*``; nothing for steps without rollouts."""
    n = float(sums.get("rollout/count", 0))
    if not n:
        return {}
    tokens = float(sums.get("rollout/tokens", 0))
    seconds = float(sums.get("rollout/seconds", 0.0))
    scores = ScoreCounts.from_sums(sums)
    return {
        "rollout/count": n / steps,
        "rollout/len_mean": tokens / n,
        "rollout/truncated_frac": scores.parsing.truncated_frac,
        "rollout/seconds": seconds / steps,
        "rollout/tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "rollout/weight_version": float(sums.get("rollout/weight_version_sum", 0)) / n,
        **scores.detection.as_metrics("match/", per=steps),
        **scores.parsing.as_metrics("parse/", per=steps),
        **scores.answers.as_metrics(scores.parsing.valid, "rollout/"),
        **{f"rollout/{name}": value for name, value in scores.count_order.summary().items()},
        **{name: float(sums.get(name, 0)) / steps for name in TARGET_SUMS},
    }


def count_bucket_metrics(sums: Sums, steps: int, count_buckets: Sequence[int]) -> dict[str, float]:
    """``match/gt_count_<bucket>/{precision,recall,f1,images}`` of the rollouts, per GT-count bucket
    (images per step); nothing for steps without rollouts."""
    if not sums.get("rollout/count", 0):
        return {}
    return CountOrderCounts.from_sums(sums).bucket_metrics("match/", count_buckets, per=steps)


def packing_metrics(sums: Sums, steps: int) -> dict[str, float]:
    """``packing/*`` over the packed rows of the logged steps."""
    rows = float(sums.get("packing/rows", 0))
    if not rows:
        return {}
    return {
        "packing/rows": rows / steps,
        "packing/segments_per_row": float(sums["packing/segments"]) / rows,
        "packing/fill_ratio": float(sums["packing/tokens"]) / float(sums["packing/capacity"]),
        # mean number of segments left waiting after a row was taken (over rows and ranks)
        "packing/carry_depth": float(sums.get("packing/carry_depth_sum", 0.0)) / rows,
    }


def sample_metrics(sums: Sums, steps: int) -> dict[str, float]:
    """``samples``, ``target/supervised_tokens`` and ``loss/weight`` per step; ``target/noise_objects`` per
    sample."""
    out = {"samples": float(sums.get("samples", 0)) / steps}
    if "target/supervised_tokens" in sums:
        out["target/supervised_tokens"] = float(sums["target/supervised_tokens"]) / steps
    if "loss/weight" in sums:
        out["loss/weight"] = float(sums["loss/weight"]) / steps
    if "target/noise_objects" in sums:  # loss.noise_objects: per GT target
        out["target/noise_objects"] = float(sums["target/noise_objects"]) / max(
            float(sums.get("samples", 0)), 1.0
        )
    return out


def stage2_metrics(sums: Sums, steps: int) -> dict[str, float]:
    """``stage2_ab/*`` and ``sync/*``: per-channel losses over that channel's steps, the rest per step."""
    out: dict[str, float] = {}
    for channel in ("a", "b"):
        channel_steps = float(sums.get(f"stage2_ab/steps_{channel}_sum", 0))
        if channel_steps:
            out[f"stage2_ab/loss_{channel}"] = float(sums[f"stage2_ab/loss_{channel}_sum"]) / channel_steps
    for key, value in sums.items():
        if key.startswith(("stage2_ab/", "sync/", "step/")) and not key.endswith("_sum"):
            out[key] = float(value) / steps
    return out


def async_metrics(sums: Sums, steps: int) -> dict[str, float]:
    """``stage2_ab/async/ver_lag_mean``: over the ready packs trained (the other async sums are per step)."""
    packs = float(sums.get("stage2_ab/async/packs_trained", 0))
    if not packs:
        return {}
    return {"stage2_ab/async/ver_lag_mean": float(sums.get("stage2_ab/async/ver_lag_sum", 0)) / packs}


def grpo_metrics(sums: Sums, steps: int) -> dict[str, float]:
    """``grpo/*`` (``loss.objective: grpo``): rewards over the rollouts, groups without signal, and over the
    trained tokens the clipped fractions, the importance ratio (mean, p05 / p50 / p95) and the KL."""
    out: dict[str, float] = {}
    rollouts = float(sums.get("grpo/rollouts", 0))
    if rollouts:
        mean = float(sums["grpo/reward_sum"]) / rollouts
        variance = max(0.0, float(sums["grpo/reward_sq_sum"]) / rollouts - mean * mean)
        groups = float(sums.get("grpo/groups", 0))
        out.update(
            {
                "grpo/reward_mean": mean,
                "grpo/reward_std": variance**0.5,
                "grpo/malformed_frac": float(sums.get("grpo/malformed", 0)) / rollouts,
                "grpo/masked_truncated_frac": float(sums.get("grpo/masked_truncated", 0)) / rollouts,
                "grpo/advantage_abs_mean": float(sums.get("grpo/advantage_abs_sum", 0)) / rollouts,
                "grpo/zero_std_group_frac": float(sums.get("grpo/groups_zero_std", 0)) / groups
                if groups
                else 0.0,
            }
        )
    tokens = float(sums.get("grpo/tokens", 0))
    if tokens:
        out.update(
            {
                "grpo/clip_frac": float(sums.get("grpo/clipped_tokens", 0)) / tokens,
                "grpo/dual_clipped_frac": float(sums.get("grpo/dual_clipped_tokens", 0)) / tokens,
                "grpo/ratio_mean": float(sums.get("grpo/ratio_sum", 0)) / tokens,
                "grpo/kl_mean": float(sums.get("grpo/kl_sum", 0)) / tokens,
                "grpo/lag_mean": float(sums.get("grpo/lag_sum", 0)) / tokens,
                "grpo/stale_frac": float(sums.get("grpo/stale_tokens", 0)) / tokens,
            }
        )
        corrected = float(sums.get("grpo/is_tokens", 0))
        if corrected:
            out["grpo/is_ratio_mean"] = float(sums.get("grpo/is_ratio_sum", 0)) / corrected
            out["grpo/is_capped_frac"] = float(sums.get("grpo/is_capped_tokens", 0)) / corrected
        quantiles = ratio_quantiles(sums)
        if quantiles:
            out["grpo/ratio_p05"], out["grpo/ratio_p50"], out["grpo/ratio_p95"] = quantiles
    return out


def server_metrics(sums: Sums, steps: int) -> dict[str, float]:
    """``servers/*`` (rollout servers): the mean number of healthy servers a rollout call saw, and per
    step the servers marked down and the calls re-sent, summed over the ranks' clients."""
    calls = float(sums.get("servers/calls", 0))
    failovers = float(sums.get("servers/failovers", 0))
    if not calls and not failovers:
        return {}
    out = {
        "servers/failovers": failovers / steps,  # also on steps without a rollout call (a failed push)
        "servers/resent_calls": float(sums.get("servers/resent_calls", 0)) / steps,
    }
    if calls:
        out["servers/healthy"] = float(sums.get("servers/healthy_sum", 0)) / calls
    return out


METRIC_FAMILIES: tuple[Callable[[Sums, int], dict[str, float]], ...] = (
    rollout_metrics,
    grpo_metrics,
    packing_metrics,
    sample_metrics,
    stage2_metrics,
    async_metrics,
    server_metrics,
)


class JsonlMetricsCallback(TrainerCallback):
    """Appends every log line (HF's and rollmatch's metrics) to ``<output_dir>/metrics.jsonl``."""

    def __init__(self, path: str):
        self.path = path

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if not state.is_world_process_zero or not logs:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a") as fh:
            fh.write(json.dumps({"step": state.global_step, **logs}) + "\n")
