"""Training metrics: additive sums -> the metric names of docs/metrics.md, and a JSONL sink.

Producers (channels, row builder, window) emit *sums* (counts, token totals, seconds), which are
summed exactly over micro-steps and ranks; only here are they turned into means, rates and F1,
over all optimizer steps since the last log line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from transformers import TrainerCallback


def summarize(sums: Mapping[str, float], steps: int) -> dict[str, float]:
    """Metric values of ``steps`` optimizer steps from their aggregated sums."""
    out: dict[str, float] = {}
    n = float(sums.get("rollout/count", 0))
    if n:
        tokens = float(sums.get("rollout/tokens", 0))
        seconds = float(sums.get("rollout/seconds", 0.0))
        out["rollout/count"] = n / steps
        out["rollout/len_mean"] = tokens / n
        out["rollout/truncated_frac"] = float(sums.get("rollout/truncated", 0)) / n
        out["rollout/seconds"] = seconds / steps
        out["rollout/tokens_per_s"] = tokens / seconds if seconds > 0 else 0.0
        out["rollout/weight_version"] = float(sums.get("rollout/weight_version_sum", 0)) / n
        tp, fp, fn = (float(sums.get(f"match/{k}", 0)) for k in ("tp", "fp", "fn"))
        precision = tp / (tp + fp) if tp + fp else 0.0
        recall = tp / (tp + fn) if tp + fn else 0.0
        out["match/precision"] = precision
        out["match/recall"] = recall
        out["match/f1"] = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        out["match/mean_iou"] = float(sums.get("match/iou_sum", 0.0)) / tp if tp else 0.0
        out["match/fn"] = fn / steps
        out["match/fp"] = fp / steps
        out["parse/valid"] = float(sums.get("parse/valid", 0)) / steps
        for key, value in sums.items():
            if key.startswith("parse/invalid_"):
                out[key] = float(value) / steps
    rows = float(sums.get("packing/rows", 0))
    if rows:
        out["packing/rows"] = rows / steps
        out["packing/segments_per_row"] = float(sums["packing/segments"]) / rows
        out["packing/fill_ratio"] = float(sums["packing/tokens"]) / float(sums["packing/capacity"])
        # mean number of segments left waiting after a row was taken (over rows and ranks)
        out["packing/carry_depth"] = float(sums.get("packing/carry_depth_sum", 0.0)) / rows
    if "loss/weight" in sums:
        out["loss/weight"] = float(sums["loss/weight"]) / steps
    out["samples"] = float(sums.get("samples", 0)) / steps
    # Stage-2 AB per-channel losses: the mean over the steps that ran that channel, not over all steps.
    for channel in ("a", "b"):
        channel_steps = float(sums.get(f"stage2_ab/steps_{channel}_sum", 0))
        if channel_steps:
            out[f"stage2_ab/loss_{channel}"] = float(sums[f"stage2_ab/loss_{channel}_sum"]) / channel_steps
    packs = float(sums.get("stage2_ab/async/packs_trained", 0))
    if packs:
        out["stage2_ab/async/ver_lag_mean"] = float(sums.get("stage2_ab/async/ver_lag_sum", 0)) / packs
    for key, value in sums.items():
        if key.startswith(("stage2_ab/", "sync/", "step/")) and not key.endswith("_sum"):
            out[key] = float(value) / steps
    return out


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
