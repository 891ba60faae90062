"""The dense study's PNG: F1 and recall per GT-count bucket per arm, each arm's F1 difference to its
baseline per bucket with the decision rule's interval, and the stage-1 gates against trunk steps.

Reads only the study's JSON (``studies/dense_summary.py`` builds it); draws nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from studies import study_rules as rules
from studies.study_protocols import PROTOCOLS


# ------------------------------------------------------------------------------------------- plot
def plot(result: dict[str, Any], path: Path) -> None:
    """F1 and recall per GT-count bucket per arm (report split, last step, mean over seeds), and each
    arm's F1 difference to ``sft`` per bucket with its 95% bootstrap interval (the decision rule's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    protocol = PROTOCOLS[result["settings"].get("preset", "crowd")]
    buckets = list(protocol.buckets)
    x = np.arange(len(buckets))
    fig, grid = plt.subplots(2, 2, figsize=(13, 9.6))
    axes = grid.flat
    stage1_dev = _stage1_dev(result["gate"])
    for ax, key in zip(axes, ("f1", "recall"), strict=False):
        for arm, summary in result["arms"].items():
            values = summary.get("report_by_bucket", {})
            seeds = len(summary["seeds"])
            label = f"{arm} ({seeds} seed{'s' * (seeds > 1)})"
            ax.plot(x, [values.get(b, {}).get(key, np.nan) for b in buckets], marker="o", label=label)
        for arm, level in result.get("sft_equal_compute", {}).items():
            values = level["report_by_bucket"]
            label = f"sft_equal_compute at {arm}'s cost ({level['sft_steps']} steps)"
            ax.plot(x, [values.get(b, {}).get(key, np.nan) for b in buckets], ls=":", marker="s", label=label)
        if stage1_dev:
            steps, dev = stage1_dev
            stage1_buckets = dev.get("gt_count_buckets") or {}
            stage1 = [stage1_buckets.get(b, {}).get(key, np.nan) for b in buckets]
            ax.plot(x, stage1, "k--", alpha=0.5, label=f"stage-1 at {steps} trunk steps (dev)")
        what = "F1@0.5 (labels required)" if key == "f1" else "recall"
        split = (
            "arms on the report split, stage-1 on dev" if result["arms"] else "stage-1 on dev (no arm ran)"
        )
        ax.set(title=f"{what}, {split}", xlabel="GT objects per image", ylabel=key, ylim=(0, 1))
    diff = axes[2]
    primary = "equal_steps" if protocol.primary_baseline == "sft" else "equal_compute"
    for offset, (arm, entry) in enumerate(result["comparisons"].items()):
        by_bucket = entry.get(primary, {}).get("by_bucket", {})
        shown = [b for b in buckets if by_bucket.get(b)]
        centre = np.array([by_bucket[b]["delta_f1"] for b in shown])
        low = centre - np.array([by_bucket[b]["ci95"][0] for b in shown])
        high = np.array([by_bucket[b]["ci95"][1] for b in shown]) - centre
        positions = np.array([buckets.index(b) for b in shown]) + 0.06 * (
            offset - len(result["comparisons"]) / 2
        )
        diff.errorbar(positions, centre, yerr=[low, high], marker="o", capsize=3, label=arm)
    answer = result.get("answer", {})
    stopped = answer.get("state") == "stopped at the gate"
    if not result["comparisons"]:
        if stopped and not answer["arms_outside_protocol"]:
            empty = f"no arm runs: the gate decided {answer['decision']}"
        else:
            empty = "no rollout arm has run yet"
        diff.text(0.5, 0.75, empty, ha="center", va="center", transform=diff.transAxes)
        diff.set_ylim(-0.1, 0.1)
    diff.axhline(0.0, color="k", lw=0.8)
    if protocol.preset == "crowd":
        diff.axhline(
            rules.CROWDED_GAIN, color="k", ls=":", lw=0.8, label=f"+{rules.CROWDED_GAIN} (26-30 clause)"
        )
    else:
        diff.axhline(
            rules.OVERALL_GAIN, color="k", ls=":", lw=0.8, label=f"+{rules.OVERALL_GAIN} (gain threshold)"
        )
    against = "sft's, equal steps" if primary == "equal_steps" else "sft_equal_compute's"
    diff.set(title=f"F1 minus {against}, 95% interval", xlabel="GT objects per image")
    for ax in grid.flat[:3]:
        ax.set_xticks(x, buckets)
    _plot_stage1(grid.flat[3], result["gate"], result["settings"], protocol.f1_gate)
    for ax in grid.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    progress = ""
    if stopped:
        anyway = ", arms run anyway (outside the protocol)" if answer["arms_outside_protocol"] else ""
        progress = f"; stopped at the gate: {answer['decision']}{anyway}"
    elif result.get("missing"):
        progress = f"; in progress, missing {len(result['missing'])} arm-seeds"
    over_seeds = ", mean over seeds" if result["arms"] else ""
    fig.suptitle(f"{protocol.title}{over_seeds} ({result['date']}, {result.get('commit', '')}{progress})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def gate_points(gate: dict[str, Any]) -> list[dict[str, Any]]:
    """Every stage-1 gate so far (trunk steps, F1, ...) from :func:`gate_summary`, decided or not."""
    return gate.get("history") or gate.get("in_progress") or []


def _plot_stage1(
    ax: Any, gate: dict[str, Any], settings: dict[str, Any], f1_gate: tuple[float, float]
) -> None:
    """Dev F1 of each stage-1 gate (its cool-down branch) against trunk steps, with the gate's F1 range
    and the step budget: how far stage-1 is from the range, and how fast it moves."""
    points = gate_points(gate)
    budget = settings["stage1_max_steps"]
    ax.axhspan(*f1_gate, color="g", alpha=0.12, label=f"gate F1 range {list(f1_gate)}")
    ax.axvline(budget, color="r", ls=":", label=f"stage-1 budget ({budget} trunk steps)")
    ax.plot(
        [p["trunk_steps"] for p in points],
        [p["f1"] for p in points],
        "ko-",
        label="dev F1@0.5 (after cool-down)",
    )
    decision = gate.get("decision", "in progress")
    ax.set(
        title=f"stage-1 gate (decision: {decision})",
        xlabel=f"trunk steps (lr {settings['stage1_lr']}) before the cool-down branch",
        ylabel="dev F1@0.5",
        xlim=(0, budget * 1.05),
        ylim=(0, 1),
    )


def _stage1_dev(gate: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
    """(trunk steps, slim dev evaluation) of the decided gate, or of the newest one while in progress."""
    if "dev" in gate:
        return gate["trunk_steps"], gate["dev"]
    newest = (gate.get("in_progress") or [None])[-1]
    return (newest["trunk_steps"], newest["dev"]) if newest else None
