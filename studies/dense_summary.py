"""The dense studies' summary, from whatever unit files ``studies/dense_study.py`` wrote.

Owns: reading the units (gate, diagnostics, pilot, each arm x seed, the equal-compute points), the
comparisons of every arm with its baseline (at equal steps and at equal compute) by the rules of
``studies/study_rules.py`` on ``studies/study_statistics.py``'s numbers, the default target chosen on
dev, and the replication check against a study with another stage-1 seed. Runs nothing; the PNG is
``studies/dense_plot.py``'s.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from studies import study_rules as rules
from studies import study_statistics as stats
from studies.study_protocols import PROTOCOLS, StudyProtocol, failed_clauses
from studies.units import arm_runs

# Kept in the summary of an evaluation (the unit files hold everything, per-image counts included).
METRICS = (
    "f1",
    "precision",
    "recall",
    "map",
    "map_uniform_score",
    "mean_iou",
    "truncated_frac",
    "duplicate_rate",
    "fp_per_image",
    "exact_count_acc",
    "objects_per_image",
    "count_error",
    "count_mae",
    "recall_first_third",
    "recall_middle_third",
    "recall_last_third",
    "kendall_tau",
)
SECONDARY = (
    "count_error",
    "count_mae",
    "recall_last_third",
    "duplicate_rate",
    "kendall_tau",
    "truncated_frac",
    "map_uniform_score",
    "fp_per_image",
)
CANDIDATE_TARGETS = (
    "prefix_fn_supervised",
    "keep_all_supervised",
    "keep_all_supervised_fp_unlikelihood",
    "keep_all_supervised_sampled_k4",
)
BASELINE_TARGET = "prefix_fn_supervised"  # the default target before the study


def summarize(
    out: Path,
    args: argparse.Namespace,
    settings: dict[str, Any],
    data: dict[str, Any],
    arms: list[str],
    pilot: dict[str, Any],
) -> dict[str, Any]:
    """The study's JSON from the unit files under ``out`` (``arms``: every arm the study knows)."""
    final = str(args.steps)
    protocol = PROTOCOLS[getattr(args, "preset", "crowd")]
    runs = {arm: arm_runs(out, arm) for arm in arms}
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "settings": settings,
        "data": data,
        "gate": gate_summary(out),
        "diagnostics": _without(_read(out / "diagnostics.json"), "config"),
        "pilot": lr_pilot_summary(out, args, protocol)
        if protocol.lr_pair
        else pilot_summary(out, args, pilot),
        "missing": [f"{arm}/seed{s}" for arm in args.arms for s in args.seeds if s not in runs[arm]],
        "arms": {arm: arm_summary(by_seed, final) for arm, by_seed in runs.items() if by_seed},
        "comparisons": {},
    }
    rng = np.random.default_rng(0)
    for arm, by_seed in runs.items():
        seeds = sorted(set(by_seed) & set(runs["sft"]))
        if arm == "sft" or not seeds:
            continue
        arm_reports = [by_seed[s]["evals"][final]["report"] for s in seeds]
        entry = {
            "seeds": seeds,
            "equal_steps": contrast(
                arm_reports,
                [runs["sft"][s]["evals"][final]["report"] for s in seeds],
                args.bootstrap,
                rng,
                protocol,
            ),
        }
        compute = equal_compute_reports(out, arm, seeds)
        if compute:
            steps, reports = compute
            paired = [by_seed[s]["evals"][final]["report"] for s in reports]
            entry["equal_compute"] = {
                "sft_steps": steps,
                "seeds": sorted(reports),
                **contrast(paired, list(reports.values()), args.bootstrap, rng, protocol),
            }
        result["comparisons"][arm] = entry
    result["answer"] = rules.study_answer(
        result["gate"].get("decision"),
        primary_verdicts(result["comparisons"], protocol),
        len(result["missing"]),
        arms_run=bool(result["arms"]),
        readings=rules.stop_readings(protocol),
        baseline=protocol.primary_baseline,
    )
    result["default_target_on_dev"] = default_target(runs, final, args.bootstrap, rng)
    if protocol.primary_baseline == "sft_equal_compute":  # the baseline's own levels, per bucket
        result["sft_equal_compute"] = equal_compute_levels(out, [a for a in runs if a != "sft" and runs[a]])
    if args.replication:
        result["replication"] = replication(result, Path(args.replication))
    return result


def primary_verdicts(comparisons: dict[str, Any], protocol: StudyProtocol) -> dict[str, bool | None]:
    """Each arm's gain by the protocol's primary rule: against ``sft`` at equal steps (crowd), against
    ``sft_equal_compute`` (medium; None while that comparison is not in)."""
    if protocol.primary_baseline == "sft":
        return {arm: c["equal_steps"]["verdict"]["gain"] for arm, c in comparisons.items()}
    return {arm: c.get("equal_compute", {}).get("verdict", {}).get("gain") for arm, c in comparisons.items()}


def contrast(
    arm: list[dict[str, Any]],
    base: list[dict[str, Any]],
    resamples: int,
    rng: np.random.Generator,
    protocol: StudyProtocol = PROTOCOLS["crowd"],
) -> dict[str, Any]:
    """Arm minus base on the same report images, seed by seed: the primary test, the buckets, the rule."""
    arm_images, base_images = [r["per_image"] for r in arm], [r["per_image"] for r in base]
    overall = stats.paired_bootstrap(arm_images, base_images, resamples, rng)
    overall["t_test"] = stats.paired_t(overall["per_seed"])
    buckets = {
        b: stats.bucket_bootstrap(arm_images, base_images, b, resamples, rng) for b in protocol.buckets
    }
    secondary = {
        m: round(float(np.mean([a[m] - b[m] for a, b in zip(arm, base, strict=True)])), 4) for m in SECONDARY
    }
    secondary["count_oracle_f1"] = round(
        float(
            np.mean(
                [
                    a["count_oracle"]["count_oracle_f1"] - b["count_oracle"]["count_oracle_f1"]
                    for a, b in zip(arm, base, strict=True)
                ]
            )
        ),
        4,
    )
    recall = {}
    for bucket in protocol.buckets:
        pairs = [
            (a["gt_count_buckets"].get(bucket), b["gt_count_buckets"].get(bucket))
            for a, b in zip(arm, base, strict=True)
        ]
        if all(a and b for a, b in pairs):
            recall[bucket] = round(float(np.mean([a["recall"] - b["recall"] for a, b in pairs])), 4)
    if protocol is PROTOCOLS["crowd"]:
        verdict = rules.gain_verdict(overall, buckets, len(arm))
    else:
        delta_map = float(np.mean([a["map"] - b["map"] for a, b in zip(arm, base, strict=True)]))
        verdict = rules.medium_verdict(overall, delta_map, secondary["truncated_frac"], len(arm))
    return {
        "overall": overall,
        "by_bucket": buckets,
        "delta_recall_by_bucket": recall,
        "delta_secondary": secondary,
        "verdict": verdict,
    }


def default_target(
    runs: dict[str, dict[int, Any]], final: str, resamples: int, rng: np.random.Generator
) -> dict[str, Any] | None:
    """The target with the best mean dev F1 at the last step (dev only: report never picks), and its
    paired bootstrap on dev against the target that was the default before."""
    dev = {
        arm: {s: r["evals"][final]["dev"] for s, r in runs[arm].items()}
        for arm in CANDIDATE_TARGETS
        if runs[arm]
    }
    if not dev:
        return None
    means = {
        arm: round(float(np.mean([e["f1"] for e in by_seed.values()])), 4) for arm, by_seed in dev.items()
    }
    best = max(means, key=lambda arm: means[arm])
    chosen: dict[str, Any] = {"chosen_on": "dev", "target": best, "dev_f1": means}
    seeds = sorted(set(dev[best]) & set(dev.get(BASELINE_TARGET, {})))
    if best != BASELINE_TARGET and seeds:
        chosen[f"versus_{BASELINE_TARGET}_on_dev"] = stats.paired_bootstrap(
            [dev[best][s]["per_image"] for s in seeds],
            [dev[BASELINE_TARGET][s]["per_image"] for s in seeds],
            resamples,
            rng,
        )
    return chosen


def replication(result: dict[str, Any], other: Path) -> dict[str, Any]:
    """Per arm: a gain here and in the study with another stage-1 seed (None: either has no verdict)."""
    theirs = _read(other / "dense_study.json")
    if theirs is None:
        raise SystemExit(
            f"--replication {other}: no dense_study.json there (run or --summarize that study first)"
        )
    differing = sorted(
        k
        for k in result["settings"]
        if k != "stage1_seed" and theirs["settings"].get(k) != result["settings"][k]
    )
    if differing or theirs["settings"]["stage1_seed"] == result["settings"]["stage1_seed"]:
        raise SystemExit(
            f"--replication {other}: not the same study with another --stage1-seed (differs in {differing})"
        )
    out: dict[str, Any] = {"study": str(other), "stage1_seed": theirs["settings"]["stage1_seed"], "arms": {}}
    for arm, entry in result["comparisons"].items():
        here = entry["equal_steps"]["verdict"]["gain"]
        there = theirs["comparisons"].get(arm, {}).get("equal_steps", {}).get("verdict", {}).get("gain")
        out["arms"][arm] = None if here is None or there is None else bool(here and there)
    return out


# ------------------------------------------------------------------------------------------ units
def cost_per_step(runs: dict[str, dict[int, Any]]) -> dict[str, Any]:
    """Each arm's cost per step from its cheapest seed (the least disturbed by other work): CPU seconds
    of the training process when every arm measured them, else wall-clock seconds (``basis`` says)."""
    for key in ("train_cpu_seconds", "train_seconds"):
        costs = {
            arm: [r[key] / r["steps"] for r in by_seed.values() if r.get(key)]
            for arm, by_seed in runs.items()
        }
        if all(costs.values()):
            return {"basis": key, **{arm: min(c) for arm, c in costs.items()}}
    raise SystemExit(
        "equal compute needs every arm trained first; no cost yet for "
        f"{[arm for arm, by_seed in runs.items() if not by_seed]}"
    )


def equal_compute_levels(out: Path, arms: list[str]) -> dict[str, Any]:
    """Per rollout arm: SFT at that arm's equal compute, its steps and report F1 / recall per bucket
    (mean over the seeds evaluated)."""
    levels = {}
    for arm in arms:
        found = equal_compute_reports(out, arm, list(range(rules.MORE_SEEDS)))
        if not found:
            continue
        steps, reports = found
        first = next(iter(reports.values()))["gt_count_buckets"]
        levels[arm] = {
            "sft_steps": steps,
            "seeds": sorted(reports),
            "report_by_bucket": {
                bucket: {
                    key: round(
                        float(np.mean([r["gt_count_buckets"][bucket][key] for r in reports.values()])), 4
                    )
                    for key in ("f1", "recall")
                }
                for bucket in first
                if all(bucket in r["gt_count_buckets"] for r in reports.values())
            },
        }
    return levels


def equal_compute_reports(out: Path, arm: str, seeds: list[int]) -> tuple[int, dict[int, Any]] | None:
    steps_file = _read(out / "arms" / "sft_equal_compute" / f"steps-{arm}.json")
    if steps_file is None:
        return None
    steps = steps_file["steps"]
    reports = {
        s: _read(out / "arms" / "sft_equal_compute" / f"seed{s}" / f"eval-{steps}-report.json") for s in seeds
    }
    done = {s: r for s, r in reports.items() if r is not None}
    return (steps, done) if done else None


def gate_summary(out: Path) -> dict[str, Any]:
    gate = _read(out / "gate.json")
    if gate is None:
        gates = [json.loads(p.read_text()) for p in chunk_gates(out)]
        return {"in_progress": [{**_gate_line(g), "dev": _slim(g["dev"])} for g in gates]}
    return {
        **_gate_line(gate),
        "decision": gate["decision"],
        **({"failed_clauses": failed_clauses(gate)} if "grpo_sampling" in gate else {}),
        **({"next_rung": gate["next_rung"]} if "next_rung" in gate else {}),
        "history": gate["history"],
        "dev": _slim(gate["dev"]),
        "commit": gate["commit"],
    }


def pilot_summary(out: Path, args: argparse.Namespace, pilot: dict[str, Any]) -> dict[str, Any] | None:
    """Cost per step per arm, dev F1, and each rollout arm's spread of the paired difference to sft
    (bootstrap over dev images, scaled to the report split's size); the seeds that spread calls for."""
    runs = {arm: arm_runs(out / "pilot", arm) for arm in pilot["arms"]}
    if not any(runs.values()):
        return None
    final, rng = str(pilot["steps"]), np.random.default_rng(0)
    summary: dict[str, Any] = {"steps": pilot["steps"], "arms": {}, "spread_at_report_size": {}}
    for arm, by_seed in runs.items():
        for seed, run in by_seed.items():
            summary["arms"][f"{arm}/seed{seed}"] = {
                "cpu_seconds_per_step": run["train_cpu_seconds"]
                and round(run["train_cpu_seconds"] / run["steps"], 2),
                "seconds_per_step": round(run["train_seconds"] / run["steps"], 2),
                "dev_f1": {step: e["dev"]["f1"] for step, e in run["evals"].items()},
            }
    scale = np.sqrt(args.dev_size / args.report_size)
    for arm, by_seed in runs.items():
        for seed in sorted(set(by_seed) & set(runs["sft"])) if arm != "sft" else []:
            a, b = by_seed[seed]["evals"][final]["dev"], runs["sft"][seed]["evals"][final]["dev"]
            spread = stats.bootstrap_spread(a["per_image"], b["per_image"], args.bootstrap, rng) * scale
            summary["spread_at_report_size"][f"{arm}/seed{seed}"] = round(float(spread), 4)
    summary["seeds_needed"] = rules.seeds_needed(list(summary["spread_at_report_size"].values()))
    return summary


def lr_pilot_summary(out: Path, args: argparse.Namespace, protocol: StudyProtocol) -> dict[str, Any] | None:
    """The learning-rate pilot (``dense_study.run_lr_pilot``): each arm's dev F1 and cost per step at each
    rate, the rate chosen, and each rollout arm's spread of the paired difference to SFT at its equal
    compute (bootstrap over dev images, scaled to the report split's size); the seeds that calls for."""
    steps, pilot = str(protocol.pilot_steps), out / "pilot"
    runs = {lr: {arm: arm_runs(pilot / f"lr{lr:g}", arm) for arm in args.arms} for lr in protocol.lr_pair}
    if not any(by_seed for by_arm in runs.values() for by_seed in by_arm.values()):
        return None
    chosen = _read(pilot / "lr_chosen.json")
    summary: dict[str, Any] = {"steps": protocol.pilot_steps, "lr_pair": list(protocol.lr_pair), "arms": {}}
    for lr, by_arm in runs.items():
        for arm, by_seed in by_arm.items():
            for seed, run in by_seed.items():
                summary["arms"][f"{arm}/lr{lr:g}/seed{seed}"] = {
                    "cpu_seconds_per_step": run["train_cpu_seconds"]
                    and round(run["train_cpu_seconds"] / run["steps"], 2),
                    "seconds_per_step": round(run["train_seconds"] / run["steps"], 2),
                    "dev_f1": run["evals"][steps]["dev"]["f1"],
                }
    summary["lr_chosen"] = chosen
    spreads: dict[str, float] = {}
    rng, scale = np.random.default_rng(0), np.sqrt(args.dev_size / args.report_size)
    for arm in [a for a in args.arms if a != "sft"] if chosen else []:
        equal = _read(pilot / "arms" / "sft_equal_compute" / f"steps-{arm}.json")
        base = equal and _read(
            pilot / "arms" / "sft_equal_compute" / "seed0" / f"eval-{equal['steps']}-dev.json"
        )
        if base is None:
            continue
        mine = runs[chosen[arm]][arm][0]["evals"][steps]["dev"]
        spread = stats.bootstrap_spread(mine["per_image"], base["per_image"], args.bootstrap, rng) * scale
        spreads[f"{arm}/seed0"] = round(float(spread), 4)
    summary["spread_at_report_size"] = spreads
    summary["seeds_needed"] = rules.seeds_needed(list(spreads.values())) if spreads else None
    return summary


def arm_summary(by_seed: dict[int, Any], final: str) -> dict[str, Any]:
    """Means over seeds: dev F1 per evaluated step, report metrics and per-bucket F1 / recall at the end."""
    reports = [
        run["evals"][final]["report"] for run in by_seed.values() if "report" in run["evals"].get(final, {})
    ]
    summary: dict[str, Any] = {
        "seeds": sorted(by_seed),
        "train_cpu_seconds": {str(s): r.get("train_cpu_seconds") for s, r in by_seed.items()},
        "train_seconds": {str(s): r["train_seconds"] for s, r in by_seed.items()},
        "dev_f1": {
            step: round(float(np.mean([r["evals"][step]["dev"]["f1"] for r in by_seed.values()])), 4)
            for step in sorted({s for r in by_seed.values() for s in r["evals"]}, key=int)
        },
    }
    if reports:
        summary["report"] = {m: round(float(np.mean([r[m] for r in reports])), 4) for m in METRICS}
        summary["report"]["count_oracle_f1"] = round(
            float(np.mean([r["count_oracle"]["count_oracle_f1"] for r in reports])), 4
        )
        summary["report_by_bucket"] = {
            bucket: {
                key: round(float(np.mean([r["gt_count_buckets"][bucket][key] for r in reports])), 4)
                for key in ("f1", "recall")
            }
            for bucket in reports[0]["gt_count_buckets"]
            if all(bucket in r["gt_count_buckets"] for r in reports)
        }
    return summary


def chunk_gates(out: Path) -> list[Path]:
    """A study's ``stage1/gate-<steps>.json`` files, in trunk-step order."""
    return sorted((out / "stage1").glob("gate-*.json"), key=lambda p: int(p.stem.split("-")[1]))


def _gate_line(gate: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "passed",
        "f1",
        "f1_side",
        "trunk_steps",
        "cooldown_steps",
        "room_for_the_mechanism",
        "targets_differing_from_sft",
        "targets_keeping_own_elements",
        "grpo_sampling",
        "rule",
    )
    return {k: gate[k] for k in keys if k in gate}


def _slim(evaluation: dict[str, Any]) -> dict[str, Any]:
    keep = {m: evaluation[m] for m in METRICS if m in evaluation}
    return {
        **keep,
        "gt_count_buckets": evaluation.get("gt_count_buckets"),
        "count_oracle": stats.count_oracle_headroom(evaluation["per_image"]),
        "decoding": evaluation.get("decoding"),
    }


def _without(data: dict[str, Any] | None, key: str) -> dict[str, Any] | None:
    return None if data is None else {k: v for k, v in data.items() if k != key}


def _read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None
