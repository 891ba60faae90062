"""The learning-signal study's summary: each arm's curves over seeds, its comparisons with ``sft`` by the
rule fixed before the run, and the PNG (``studies/learning_signal.py`` runs the units; this reads them).

The rule: a *gain* is >= ``GAIN`` F1 over ``sft`` at every decision step, with the paired bootstrap's
95% interval above 0 and the same sign in most seeds, mAP not lower by more than ``MAP_SLACK`` and the
truncated fraction not higher; no verdict on fewer than ``MIN_SEEDS`` seeds.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from studies.study_statistics import paired_bootstrap

GAIN, MAP_SLACK = 0.03, 0.01  # decided before the run
MIN_SEEDS = 3  # decided before the run: no verdict on fewer


# ------------------------------------------------------------------------------------- comparisons
def compare(
    runs: dict[str, dict[int, Any]], rollout_arms: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    """Each rollout arm vs ``sft`` at equal steps (every decision step) and vs ``sft_equal_compute``;
    each other rollout arm also vs ``prefix_fn`` (the default target before the study), which decides
    the default among the targets whether or not any of them beats SFT."""
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {}
    for arm in rollout_arms:
        seeds = sorted(set(runs[arm]) & set(runs["sft"]))
        if not seeds:
            continue
        equal_steps = {}
        for step in args.decide_at:
            equal_steps[str(step)] = contrast(runs, arm, "sft", seeds, str(step), str(step), args, rng)
        verdict = all(
            c["delta_f1"] >= GAIN
            and c["ci95"][0] > 0
            and sum(d > 0 for d in c["per_seed"]) > len(seeds) / 2
            and c["delta_map"] >= -MAP_SLACK
            and c["delta_truncated_frac"] <= 0
            for c in equal_steps.values()
        )
        entry: dict[str, Any] = {
            "seeds": seeds,
            "equal_steps": equal_steps,
            # The protocol's verdict needs MIN_SEEDS seeds; fewer: the numbers, no verdict.
            "gain_at_equal_steps": verdict if len(seeds) >= MIN_SEEDS else None,
        }
        compute_seeds = sorted(set(seeds) & set(runs["sft_equal_compute"]))
        if compute_seeds:
            base_step = {s: str(runs["sft_equal_compute"][s]["steps"]) for s in compute_seeds}
            entry["equal_compute"] = contrast(
                runs, arm, "sft_equal_compute", compute_seeds, str(args.steps), base_step, args, rng
            )
        target_seeds = sorted(set(runs[arm]) & set(runs["prefix_fn"]))
        if arm != "prefix_fn" and target_seeds:
            entry["versus_prefix_fn"] = {
                str(step): contrast(runs, arm, "prefix_fn", target_seeds, str(step), str(step), args, rng)
                for step in args.decide_at
            }
        out[arm] = entry
    return out


def contrast(
    runs: dict[str, dict[int, Any]],
    arm: str,
    base: str,
    seeds: list[int],
    step: str,
    base_step: str | dict[int, str],
    args: argparse.Namespace,
    rng: np.random.Generator,
) -> dict[str, Any]:
    def report(name: str, seed: int, at: str) -> dict[str, Any]:
        return runs[name][seed]["evals"][at]["report"]

    base_at = {s: base_step if isinstance(base_step, str) else base_step[s] for s in seeds}
    arm_reports = [report(arm, s, step) for s in seeds]
    base_reports = [report(base, s, base_at[s]) for s in seeds]
    result = paired_bootstrap(
        [r["per_image"] for r in arm_reports], [r["per_image"] for r in base_reports], args.bootstrap, rng
    )
    for metric in ("map", "truncated_frac", "duplicate_rate", "fp_per_image", "exact_count_acc"):
        delta = np.mean([a[metric] - b[metric] for a, b in zip(arm_reports, base_reports, strict=True)])
        result[f"delta_{metric}"] = round(float(delta), 4)
    return result


def summarize_arm(by_seed: dict[int, Any]) -> dict[str, Any]:
    """Mean over seeds of the dev curve and the report metrics at each step evaluated on report."""
    summary: dict[str, Any] = {"seeds": sorted(by_seed), "train_seconds": {}, "train_cpu_seconds": {}}
    for seed, run in by_seed.items():
        summary["train_seconds"][str(seed)] = run["train_seconds"]
        summary["train_cpu_seconds"][str(seed)] = run.get("train_cpu_seconds")
    steps = sorted({step for run in by_seed.values() for step in run["evals"]}, key=int)
    for split in ("dev", "report"):
        curve = {}
        for step in steps:
            evals = [
                run["evals"][step][split] for run in by_seed.values() if split in run["evals"].get(step, {})
            ]
            if evals:
                curve[step] = {
                    metric: round(float(np.mean([e[metric] for e in evals])), 4)
                    for metric in (
                        "f1",
                        "map",
                        "mean_iou",
                        "truncated_frac",
                        "duplicate_rate",
                        "fp_per_image",
                        "exact_count_acc",
                        "objects_per_image",
                    )
                }
                curve[step]["recall_by_gt_count"] = {
                    k: round(float(np.mean([e["recall_by_gt_count"].get(k, 0.0) for e in evals])), 4)
                    for k in evals[0]["recall_by_gt_count"]
                }
        summary[split] = curve
    return summary


# ------------------------------------------------------------------------------------------- plot
def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("f1", "dev F1@0.5 (labels required)"),
        ("duplicate_rate", "dev duplicate rate"),
        ("exact_count_acc", "dev exact-count accuracy"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4))
    stage1 = result["gate"]["dev"]
    for ax, (metric, title) in zip(axes, panels, strict=True):
        for arm, summary in result["arms"].items():
            if arm == "sft_equal_compute":
                continue
            steps = [0, *(int(s) for s in summary["dev"])]
            values = [stage1[metric], *(v[metric] for v in summary["dev"].values())]
            seeds = len(summary["seeds"])
            ax.plot(steps, values, marker="o", label=f"{arm} ({seeds} seed{'s' * (seeds > 1)})")
        ax.set(title=title, xlabel="optimizer steps after stage-1")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    progress = f"; in progress, missing {len(result['missing'])} arm-seeds" if result.get("missing") else ""
    fig.suptitle(f"learning signal, mean over seeds ({result['date']}, {result['commit']}{progress})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
