"""Does learning from own rollouts beat more SFT? A study powered to see it, decided in advance.

Design (docs/runbook.md, "Does it learn?"):

- **Data**: coloured shapes with 3-5 objects of 44-80 px (``--objects 2-4`` for the fallback),
  a third of the images with two shapes on one row, so order and duplicates matter; 4,000 train
  images, a *dev* split (its own generator seed) for every decision and a *report* split (another
  seed) evaluated only at the decision steps (750 and 1,000 by default).
- **Stage-1**: a tiny Qwen3-VL (text rope theta 10), SFT at 2e-3 with a cool-down
  (``warmup_stable_decay``, the last 15% of the steps down to the arms' learning rate), so "more
  SFT" is not just an annealing gain.
- **Gate** (on dev, before any arm): label-aware F1@0.5 in [0.4, 0.8] and at least a quarter of
  the rollout targets differ from the SFT target. A failed gate stops the study and says so.
- **Arms**, from the same checkpoint, the same records per seed and the same learning rate
  (HF's ``constant`` schedule, no warm-up): ``sft`` (more stage-1), ``prefix_fn`` (rollout matching, prefix
  unsupervised), ``prefix_fn_supervised`` (matched prefix supervised), ``reordered_gt``,
  ``stage2_ab`` (b_ratio 0.5, Channel-B on reordered-GT targets); ``--steps`` optimizer steps.
  ``sft_equal_compute`` continues SFT to the rollout arms' mean training cost, run after every seed's
  arms: each arm's cost per step from its least-disturbed seed, in CPU seconds of the training process
  (wall-clock for runs that did not measure them; the JSON says which).
- **Statistics**, fixed before the run: paired bootstrap over seeds x report images of the
  label-aware F1 difference to ``sft``; a *gain* is >= +0.03 at every decision step with the 95%
  interval above 0 and the same sign in most seeds, mAP not lower by more than 0.01 and the
  truncated fraction not higher. Evaluation matching is the study's (``eval.matching``: IoU 0.5,
  labels required), never an arm's.

Every unit of work (stage-1, gate, each arm x seed, each evaluation) writes its own JSON under
``--out``; a rerun skips what is done and resumes an interrupted arm from its last checkpoint.
Prints ONE JSON object (also ``--out/learning_signal.json``) and a PNG; ``--docs`` copies both
into docs/. ``--summarize`` writes them from the units already done and runs nothing (a study in
progress: the JSON lists what is missing, and no verdict is given on fewer than 3 seeds). Run (many
CPU hours on 2 cores; stop and rerun at will)::

    .venv/bin/python -m studies.learning_signal --out runs/learning_signal --docs
    .venv/bin/python -m studies.learning_signal --out runs/learning_signal --summarize --docs  # so far
    # coordinate tokens vs digits (docs/detection.md), same regime, stage-1 and the best rollout arm,
    # then the two studies paired on the same images (studies/compare_studies.py):
    .venv/bin/python -m studies.learning_signal --out runs/learning_signal_coord --object-format coord_tokens \
        --arms sft prefix_fn_supervised --docs
    .venv/bin/python -m studies.compare_studies --study runs/learning_signal_coord \
        --baseline runs/learning_signal --docs
    # a second stage-1 seed (initialisation and data order) per format, for a seed-level interval:
    .venv/bin/python -m studies.learning_signal --out runs/learning_signal_s1 --stage1-seed 1 \
        --arms sft prefix_fn_supervised
    # the zero-training diagnostics of a stage-1 (docs/detection.md "Diagnostics"), no arms:
    .venv/bin/python -m studies.learning_signal --out runs/learning_signal --diagnose
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import rollmatch  # noqa: F401  (environment workarounds before transformers loads)
from rollmatch.config.load import load_config_dict
from rollmatch.config.schema import LossConfig, RollmatchConfig
from rollmatch.data.records import Record, load_records
from rollmatch.data.shapes import ShapesDifficulty
from studies import learning_signal_summary as summary
from studies.shapes_recipe import base_config, data_summary, generate_splits, target_reading
from studies.units import (
    cached,
    copy_processor,
    default_backend,
    evaluate,
    git_commit,
    train_with_cost,
)

ROLLOUT_ARMS: dict[str, dict[str, Any]] = {
    "reordered_gt": {"variant": "rollout_matching_sft", "loss": {"target": "reordered_gt"}},
    "prefix_fn": {
        "variant": "rollout_matching_sft",
        "loss": {"target": "prefix_fn", "matched_prefix": "none"},
    },
    "prefix_fn_supervised": {
        "variant": "rollout_matching_sft",
        "loss": {"target": "prefix_fn", "matched_prefix": "supervise"},
    },
    "stage2_ab": {"variant": "stage2_ab_training", "loss": {"target": "reordered_gt"}},
}
ARMS: dict[str, dict[str, Any]] = {"sft": {"variant": "sft", "loss": {}}, **ROLLOUT_ARMS}
OBJECTS = {"3-5": (3, 5), "2-4": (2, 4)}
SIDES = (44, 80)
F1_GATE = (0.4, 0.8)
DIFFERS_GATE = 0.25
# Smallest setting (tests/studies/test_study_smoke.py runs it; docs/runbook.md "Benchmarks").
# A few images and steps, one seed, SFT and one rollout arm (so SFT at equal compute runs too); a
# stage-1 of 2 steps fails the gate, hence --ignore-gate. Its numbers only show that the script runs.
SMOKE_ARGS = (
    "--out {tmp}/learning_signal --train-size 8 --dev-size 4 --report-size 4 --stage1-steps 2 --steps 2 "
    "--eval-at 2 --decide-at 2 --seeds 0 --arms sft prefix_fn_supervised --max-new-tokens 16 --backend hf "
    "--bootstrap 10 --ignore-gate"
)
SMOKE_KEYS = ("settings", "data", "gate", "arms", "comparisons")


def main() -> None:
    args = parse_args()
    with contextlib.redirect_stdout(sys.stderr):  # the trainer prints its logs; stdout is the JSON alone
        result = run_study(args)
    print(json.dumps(result))


def run_study(args: argparse.Namespace) -> dict[str, Any]:
    """Every unit not done yet, then the summary (also written to ``--out``)."""
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    settings = {
        k: v
        for k, v in vars(args).items()
        if k not in ("out", "docs", "argv", "only_gate", "ignore_gate", "summarize", "diagnose")
    }
    settings_path = out / "settings.json"
    saved = json.loads(settings_path.read_text()) if settings_path.exists() else settings
    if any(saved.get(key, value) != value for key, value in settings.items()):  # newer keys: defaults
        raise SystemExit(f"{out} holds a study with other settings ({settings_path}); use another --out")
    settings_path.write_text(json.dumps(settings, indent=1))
    started = time.perf_counter()
    if args.summarize and not (out / "gate.json").exists():
        raise SystemExit(f"{out} has no gate result yet: nothing to summarize (run the study first)")
    splits = prepare_data(out, args)
    stage1 = None if args.summarize else stage1_checkpoint(out, splits, args)
    gate = cached(out / "gate.json", lambda: run_gate(out, stage1, splits, args))
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "commit": git_commit(),
        "command": "python -m studies.learning_signal " + " ".join(args.argv),
        "machine": {"cpus": os.cpu_count(), "load_avg": list(os.getloadavg())},
        "settings": settings,
        "data": data_summary(splits),
        "gate": gate,
    }
    if args.diagnose and not args.summarize:
        cached(out / "diagnostics.json", lambda: run_diagnostics(out, stage1, splits, args))
    if (out / "diagnostics.json").exists():
        result["diagnostics"] = json.loads((out / "diagnostics.json").read_text())
    if (gate["passed"] or args.ignore_gate) and not (args.only_gate or args.diagnose):
        runs: dict[str, dict[int, Any]] = {arm: {} for arm in [*ARMS, "sft_equal_compute"]}
        missing = []
        # Every seed's arms first, then SFT at equal compute: its step count comes from the cost per
        # step of every arm-seed run so far (equal_compute_steps), the same for every seed.
        units = [(seed, arm) for seed in args.seeds for arm in args.arms]
        if "sft" in args.arms and set(args.arms) & set(ROLLOUT_ARMS):
            units += [(seed, "sft_equal_compute") for seed in args.seeds]
        for seed, arm in units:
            if args.summarize:  # only what is done
                done = out / "arms" / arm / f"seed{seed}.json"
                if done.exists():
                    runs[arm][seed] = json.loads(done.read_text())
                else:
                    missing.append(f"{arm}/seed{seed}")
            elif arm == "sft_equal_compute":
                runs[arm][seed] = run_equal_compute(out, seed, stage1, splits, runs, args)
            else:
                runs[arm][seed] = run_arm(out, arm, seed, stage1, splits, args)
        result["complete"] = not missing
        result["missing"] = missing
        result["arms"] = {arm: summary.summarize_arm(by_seed) for arm, by_seed in runs.items() if by_seed}
        result["comparisons"] = summary.compare(runs, list(ROLLOUT_ARMS), args)
    result["seconds_this_invocation"] = round(time.perf_counter() - started, 1)
    (out / "learning_signal.json").write_text(json.dumps(result, indent=1))
    if "arms" in result:
        summary.plot(result, out / "learning_signal.png")
    if args.docs:  # one name per object format: the two studies' documents sit side by side
        name = "learning_signal" + ("" if args.object_format == "qwen_json" else f"_{args.object_format}")
        for suffix in (".json", ".png"):
            if (out / f"learning_signal{suffix}").exists():
                shutil.copy(
                    out / f"learning_signal{suffix}", Path(__file__).parents[1] / "docs" / f"{name}{suffix}"
                )
    return result


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m studies.learning_signal", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", default="runs/learning_signal")
    parser.add_argument("--objects", choices=sorted(OBJECTS), default="3-5")
    parser.add_argument("--train-size", type=int, default=4000)
    parser.add_argument("--dev-size", type=int, default=400)
    parser.add_argument("--report-size", type=int, default=400)
    parser.add_argument("--stage1-steps", type=int, default=9000, help="3,000 failed the gate (dev F1 0.23)")
    parser.add_argument("--stage1-lr", type=float, default=2e-3)
    parser.add_argument(
        "--stage1-seed", type=int, default=0, help="stage-1 init and data order (a second seed replicates)"
    )
    parser.add_argument(
        "--lr", type=float, default=2e-4, help="every arm's (HF constant schedule, no warm-up)"
    )
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps per arm and seed")
    parser.add_argument("--eval-at", type=int, nargs="+", default=[250, 500, 750, 1000], help="dev evals")
    parser.add_argument("--decide-at", type=int, nargs="+", default=[750, 1000], help="report evals")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument(
        "--object-format",
        choices=["qwen_json", "coord_tokens"],
        default="qwen_json",
        help="coordinates as digits or as coordinate tokens (compare two studies with different --out)",
    )
    parser.add_argument("--backend", choices=["hf", "vllm"], default=default_backend())
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    parser.add_argument("--only-gate", action="store_true", help="stop after stage-1 and the gate")
    parser.add_argument(
        "--diagnose", action="store_true", help="stage-1, gate, then `rollmatch diagnose` on dev (no arms)"
    )
    parser.add_argument(
        "--ignore-gate",
        action="store_true",
        help="run the arms even if the gate fails (smoke runs; the JSON says so)",
    )
    parser.add_argument("--docs", action="store_true", help="copy the JSON and PNG into docs/")
    parser.add_argument(
        "--summarize",
        action="store_true",
        help="write the JSON and PNG from the units already done; run nothing (a study in progress)",
    )
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    if not set(args.decide_at) <= set(args.eval_at) or max(args.eval_at) != args.steps:
        parser.error("--decide-at must be a subset of --eval-at, and --eval-at must end at --steps")
    return args


# ------------------------------------------------------------------------------------------ data
def prepare_data(out: Path, args: argparse.Namespace) -> dict[str, Path]:
    """train (seed 0), dev (seed 1) and report (seed 2): the same generator, independent images."""
    low, high = OBJECTS[args.objects]
    difficulty = ShapesDifficulty(
        min_objects=low, max_objects=high, min_side=SIDES[0], max_side=SIDES[1], tied_row_frac=1 / 3
    )
    sizes = {"train": args.train_size, "dev": args.dev_size, "report": args.report_size}
    return generate_splits(out, sizes, difficulty)


# --------------------------------------------------------------------------------------- stage-1
def stage1_checkpoint(out: Path, splits: dict[str, Path], args: argparse.Namespace) -> Path:
    from rollmatch.models.tiny import TinySize, build_tiny_model
    from rollmatch.training.entry import run_training

    final = out / "stage1" / "final"
    if (final / "config.json").exists():
        return final
    model = out / "model"
    if not (model / "config.json").exists():
        build_tiny_model(
            "qwen3_vl",
            model,
            seed=args.stage1_seed,
            size=TinySize(rope_theta=10.0),
            coord_tokens=args.object_format == "coord_tokens",
        )
    cfg = base_config(out / "stage1", str(model), splits, args, seed=args.stage1_seed)
    cfg["custom"]["trainer_variant"] = "sft"
    cfg["training"].update(
        {
            "max_steps": args.stage1_steps,
            "learning_rate": args.stage1_lr,
            "warmup_ratio": 0.02,
            "lr_scheduler_type": "warmup_stable_decay",
            # cool down over the last 15% of the steps to the arms' learning rate
            "lr_scheduler_kwargs": {
                "num_decay_steps": int(0.15 * args.stage1_steps),
                "min_lr_ratio": args.lr / args.stage1_lr,
            },
            # a checkpoint every 1,000 steps: an interrupted stage-1 resumes from the newest
            "save_steps": min(1000, args.stage1_steps),
        }
    )
    if any((out / "stage1").glob("checkpoint-*/rollmatch_complete.json")):
        cfg["training"]["resume_from_checkpoint"] = "latest"
    run_training(load_config_dict(cfg, [], source="studies/learning_signal.py stage-1"))
    return final


def run_diagnostics(
    out: Path, stage1: Path, splits: dict[str, Path], args: argparse.Namespace
) -> dict[str, Any]:
    """``rollmatch diagnose`` on dev (no training): token-id differences of each target to SFT's,
    reordered-GT targets that differ only by an appended miss, the prefix-sensitivity probe."""
    from rollmatch.diagnostics import run_diagnose

    cfg = load_config_dict(
        base_config(out / "diagnostics", str(stage1), splits, args, seed=0), [], source="diagnose"
    )
    return run_diagnose(cfg, load_records(splits["dev"]), [1, 2, 3])


def run_gate(out: Path, stage1: Path, splits: dict[str, Path], args: argparse.Namespace) -> dict[str, Any]:
    """Stage-1 on dev: label-aware F1 in range, and how often a rollout target differs from SFT's."""
    dev = load_records(splits["dev"])
    cfg = load_config_dict(base_config(out / "gate", str(stage1), splits, args, seed=0), [], source="gate")
    evaluation = evaluate(cfg, str(stage1), dev, out / "gate" / "dev.predictions.jsonl")
    differs = target_difference(cfg, stage1, dev, out / "gate" / "dev.predictions.jsonl")
    passed = F1_GATE[0] <= evaluation["f1"] <= F1_GATE[1] and all(v >= DIFFERS_GATE for v in differs.values())
    return {
        "passed": bool(passed),
        "rule": f"label-aware dev F1@0.5 in {list(F1_GATE)} and >= {DIFFERS_GATE} of targets differ from SFT's",
        "dev": evaluation,
        "targets_differing_from_sft": differs,
    }


def target_difference(
    cfg: RollmatchConfig,
    stage1: Path,
    dev: list[Record],
    predictions: Path,
    losses: dict[str, LossConfig] | None = None,
) -> dict[str, float]:
    """Fraction of dev rollouts (stage-1's greedy answers) whose target holds other token ids than the
    SFT target (weights alone do not count: equal ids train on SFT's own states); ``losses``: the
    targets by name (default: this study's rollout arms, each with its own loss settings)."""
    if losses is None:  # the rollout arms that train on rollouts alone, with the arms' own loss settings
        losses = {
            name: LossConfig(**ROLLOUT_ARMS[name]["loss"])
            for name in ("prefix_fn", "prefix_fn_supervised", "reordered_gt")
        }
    reading = target_reading(cfg, stage1, dev, predictions, losses)
    return {name: shares["differs"] for name, shares in reading.items()}


# ------------------------------------------------------------------------------------------- arms
def arm_config(
    out: Path,
    arm: str,
    seed: int,
    stage1: Path,
    splits: dict[str, Path],
    args: argparse.Namespace,
    steps: int,
) -> RollmatchConfig:
    """One arm: the same records (seed) and learning rate; only the variant and target differ."""
    spec = ARMS["sft" if arm == "sft_equal_compute" else arm]
    config = base_config(out, str(stage1), splits, args, seed=seed)
    config["custom"]["trainer_variant"] = spec["variant"]
    config["preflight"] = {"records": 0}  # every arm starts from the one gated stage-1 model
    config["loss"] = spec["loss"]
    config["training"].update(
        {
            "max_steps": steps,
            "learning_rate": args.lr,
            # A no-op under the arms' `constant` schedule (HF's `constant` ignores it); kept so the
            # recorded configs of earlier runs still compare equal.
            "warmup_ratio": min(0.05, 50 / steps),
            "save_steps": min(args.eval_at) if arm != "sft_equal_compute" else steps,
        }
    )
    if (out / "trainer_state.json").exists() or any(out.glob("checkpoint-*")):
        config["training"]["resume_from_checkpoint"] = "latest"
    if spec["variant"] == "stage2_ab_training":
        config["stage2_ab"] = {
            "schedule": {"b_ratio": 0.5},
            "channel_b": {"mode": "micro", "rollout_decode_batch_size": 8},
        }
    return load_config_dict(config, [], source=f"studies/learning_signal.py {arm}")


def run_arm(
    out: Path, arm: str, seed: int, stage1: Path, splits: dict[str, Path], args: argparse.Namespace
) -> dict[str, Any]:
    """Train (resuming an interrupted run), then evaluate each checkpoint: dev always, report at the
    decision steps."""
    folder = out / "arms" / arm / f"seed{seed}"
    return cached(
        out / "arms" / arm / f"seed{seed}.json",
        lambda: train_and_evaluate(folder, arm, seed, stage1, splits, args, args.steps),
    )


def run_equal_compute(
    out: Path,
    seed: int,
    stage1: Path,
    splits: dict[str, Path],
    runs: dict[str, Any],
    args: argparse.Namespace,
) -> dict[str, Any]:
    folder = out / "arms" / "sft_equal_compute" / f"seed{seed}"

    def train() -> dict[str, Any]:
        steps, basis = equal_compute_steps(runs, args.steps)
        return {**train_and_evaluate(folder, "sft_equal_compute", seed, stage1, splits, args, steps), **basis}

    return cached(out / "arms" / "sft_equal_compute" / f"seed{seed}.json", train)


def equal_compute_steps(runs: dict[str, Any], steps: int) -> tuple[int, dict[str, Any]]:
    """SFT steps that cost what ``steps`` steps of the rollout arms cost on average: each arm's cost per
    step is its cheapest seed's (the least disturbed by other work on the machine), in CPU seconds of
    the training process when every arm has a seed that measured them, else wall-clock seconds."""

    def per_step(arm: str, key: str) -> float | None:
        costs = [run[key] / run["steps"] for run in runs[arm].values() if run.get(key)]
        return min(costs) if costs else None

    rollout_arms = [arm for arm in ROLLOUT_ARMS if runs[arm]]
    for key in ("train_cpu_seconds", "train_seconds"):
        sft, arms = per_step("sft", key), [per_step(arm, key) for arm in rollout_arms]
        if sft and all(arms):
            ratio = float(np.mean([a for a in arms if a])) / sft
            count = max(steps, min(round(steps * ratio), 20 * steps))
            return count, {"compute_basis": key, "rollout_over_sft_cost_per_step": round(ratio, 3)}
    raise SystemExit("equal compute needs the sft arm and a rollout arm trained first")


def train_and_evaluate(
    folder: Path,
    arm: str,
    seed: int,
    stage1: Path,
    splits: dict[str, Path],
    args: argparse.Namespace,
    steps: int,
) -> dict[str, Any]:
    cfg = arm_config(folder, arm, seed, stage1, splits, args, steps)
    seconds, cpu_seconds = train_with_cost(cfg, folder, steps)
    evals: dict[str, Any] = {}
    eval_steps = [steps] if arm == "sft_equal_compute" else args.eval_at
    for step in eval_steps:
        checkpoint = folder / "final" if step == steps else folder / f"checkpoint-{step}"
        copy_processor(stage1, checkpoint)
        splits_here = ["dev", "report"] if (step in args.decide_at or arm == "sft_equal_compute") else ["dev"]
        evals[str(step)] = {
            split: cached(
                folder / f"eval-{step}-{split}.json",
                lambda split=split, checkpoint=checkpoint, step=step: evaluate(
                    cfg, str(checkpoint), load_records(splits[split]), folder / f"preds-{step}-{split}.jsonl"
                ),
            )
            for split in splits_here
        }
    return {
        "steps": steps,
        "train_seconds": round(seconds, 1),
        "train_cpu_seconds": None if cpu_seconds is None else round(cpu_seconds, 1),
        "evals": evals,
    }


if __name__ == "__main__":
    main()
