"""Learning signal at equal optimizer steps: more stage-1 SFT vs rollout matching vs Stage-2 AB.

From one stage-1 checkpoint per dataset, every arm trains the same number of optimizer steps
(``--steps``) with the same seeds (``--seeds``), batch, learning rate and rollout settings:

- ``sft``: continued stage-1 (teacher forcing on the GT serialization);
- ``rollout_matching_sft``: every step on the model's own rollouts (prefix + missed GT);
- ``stage2_ab_training``: ``b_ratio`` 0.5, Channel-B ``micro`` (half the steps on rollouts).

Every ``--eval-every`` steps each run's checkpoint is evaluated on a *report* split that nothing
was tuned on: F1@0.5, mAP, TP / FP / FN counts, truncated fraction, duplicate-object rate (a
predicted object with the label of an earlier one in the same answer and IoU >= 0.7 with it) and
objects per image. Prints ONE JSON object (per dataset and arm: mean and spread over seeds at every
evaluated step, training wall-clock) and writes it, with a PNG (F1, truncated fraction and
duplicate rate vs step per arm), to ``--out``.

Datasets:

- ``shapes``: the demo's generator and stage-1 recipe (``rollmatch.demo``); the stage-1 checkpoint
  is the demo's own (reused from ``--out/shapes`` when present). Report split: 96 images of the
  same generator with another seed (the demo's val split, which the recipe was tuned on, is not
  used here).
- ``aquarium``: ``../shared/data/aquarium_combined_v2`` through the YOLO converter; ``valid`` (127
  images) trains stage-1 and the arms, ``test`` (63 images) reports. Images are resized by the
  processor like every input (at most 224x224 pixels).

Run (about an hour on 2 idle cores; every run is cached under ``--out``, so a rerun resumes)::

    .venv/bin/python bench/learning_signal.py --out runs/learning_signal --png docs/learning_signal.png
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import rollmatch  # noqa: F401  (environment workarounds before transformers loads)
from rollmatch.config.load import load_config_dict
from rollmatch.config.schema import RollmatchConfig
from rollmatch.data.convert import from_yolo, read_yolo_names
from rollmatch.data.records import Record, load_records, write_records
from rollmatch.data.shapes import generate_shapes
from rollmatch.detection.objects import iou
from rollmatch.evaluation import run_eval

ARMS = ("sft", "rollout_matching_sft", "stage2_ab_training")
METRICS = ("f1", "map", "tp", "fp", "fn", "truncated_frac", "duplicate_rate", "objects_per_image")
DUPLICATE_IOU = 0.7
AQUARIUM = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "aquarium_combined_v2"
# Processor-side files a checkpoint needs to be evaluated (HF checkpoints hold only the model).
_PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "processor_config.json")


@dataclass
class Dataset:
    """One dataset of the study: its splits, its stage-1 checkpoint and its rollout length."""

    name: str
    train_jsonl: Path
    report_jsonl: Path
    stage1_dir: Path
    max_new_tokens: int
    max_length: int  # training.global_max_length: one packed row holds a micro-batch of 8 targets


def main() -> None:
    args = parse_args()
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "commit": _git_commit(),
        "command": "python bench/learning_signal.py " + " ".join(args.argv),
        "machine": {"cpus": os.cpu_count(), "load_avg_at_start": list(os.getloadavg())},
        "settings": {
            k: getattr(args, k) for k in ("steps", "eval_every", "seeds", "learning_rate", "backend")
        },
        "datasets": {},
    }
    settings_path = out / "settings.json"
    if settings_path.exists() and json.loads(settings_path.read_text()) != result["settings"]:
        raise SystemExit(f"{out} holds runs made with other settings ({settings_path}); use another --out")
    settings_path.write_text(json.dumps(result["settings"]))
    for name in args.datasets:
        dataset = prepare_shapes(out, args) if name == "shapes" else prepare_aquarium(out, args)
        result["datasets"][name] = study(dataset, out / name, args)
    result["seconds_total"] = round(time.perf_counter() - started, 1)
    result["machine"]["load_avg_at_end"] = list(os.getloadavg())
    (out / "learning_signal.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "learning_signal.png")
    if args.png:
        shutil.copy(out / "learning_signal.png", args.png)
    print(json.dumps(result))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/learning_signal")
    parser.add_argument(
        "--datasets", nargs="+", choices=["shapes", "aquarium"], default=["shapes", "aquarium"]
    )
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per arm and seed")
    parser.add_argument("--eval-every", type=int, default=20, help="evaluate every K steps")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--learning-rate", type=float, default=3e-4, help="constant, the same for every arm")
    parser.add_argument("--backend", choices=["hf", "vllm"], default="hf", help="rollouts and evaluation")
    parser.add_argument("--report-size", type=int, default=96, help="shapes report images")
    parser.add_argument("--aquarium-stage1-steps", type=int, default=800)
    parser.add_argument("--png", help="also copy the PNG here (e.g. docs/learning_signal.png)")
    import sys

    args = parser.parse_args()
    args.argv = sys.argv[1:]
    return args


# ------------------------------------------------------------------------------------- datasets
def prepare_shapes(out: Path, args: argparse.Namespace) -> Dataset:
    """The demo's model, data and stage-1 phase; a report split from another generator seed."""
    from rollmatch.demo import SFT_PHASE, SHAPES, build_inputs, phase_config
    from rollmatch.training.entry import run_training

    root = out / "shapes"
    build_inputs(root)
    report_dir = out / "shapes_report"
    if not (report_dir / "val.jsonl").exists():
        generate_shapes(
            report_dir,
            n_train=1,
            n_val=args.report_size,
            size=SHAPES["size"],
            seed=SHAPES["seed"] + 1,
            difficulty=SHAPES["difficulty"],
        )
    stage1 = root / "sft" / "final"
    if not (stage1 / "config.json").exists():
        run_training(
            phase_config(root, SFT_PHASE, [f"custom.extra.rollout_matching.rollout_backend={args.backend}"])
        )
    return Dataset(
        "shapes",
        root / "data" / "train.jsonl",
        report_dir / "val.jsonl",
        stage1,
        max_new_tokens=160,
        max_length=4096,
    )


def prepare_aquarium(out: Path, args: argparse.Namespace) -> Dataset:
    """YOLO ``valid`` -> train JSONL, ``test`` -> report JSONL; stage-1 SFT from the demo's tiny model."""
    from rollmatch.demo import SFT_PHASE, build_inputs, phase_config
    from rollmatch.training.entry import run_training

    root = out / "aquarium"
    names = read_yolo_names(AQUARIUM / "data.yaml")
    splits = {"train": "valid", "report": "test"}
    paths = {key: root / "data" / f"{key}.jsonl" for key in splits}
    for key, split in splits.items():
        if not paths[key].exists():
            write_records(paths[key], from_yolo(AQUARIUM / split, names, dropped=[]))
    build_inputs(root, with_data=False)
    stage1 = root / "sft" / "final"
    if not (stage1 / "config.json").exists():
        overrides = [
            f"data.train_jsonl={paths['train']}",
            "data.val_jsonl=null",
            f"training.max_steps={args.aquarium_stage1_steps}",
            "training.global_max_length=16384",
            f"custom.extra.rollout_matching.rollout_backend={args.backend}",
        ]
        run_training(phase_config(root, SFT_PHASE, overrides))
    # GT answers reach ~1,400 tokens (45 fish); 512 new tokens fit images with up to ~16 objects.
    return Dataset("aquarium", paths["train"], paths["report"], stage1, max_new_tokens=512, max_length=16384)


# ---------------------------------------------------------------------------------------- study
def study(dataset: Dataset, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Every arm x seed from the stage-1 checkpoint; mean and spread per evaluated step."""
    report = load_records(dataset.report_jsonl)
    base = arm_config(dataset, "sft", 0, root / "stage1_eval", args)
    stage1_eval = cached(
        root / "stage1_eval.json",
        lambda: evaluate(base, str(dataset.stage1_dir), report, root / "stage1_preds.jsonl"),
    )
    arms: dict[str, Any] = {}
    for arm in ARMS:
        runs = [run_arm(dataset, arm, seed, root / arm / f"seed{seed}", report, args) for seed in args.seeds]
        steps = [0, *sorted(int(s) for s in runs[0]["evals"])]
        curves = {
            metric: [
                [stage1_eval[metric], *(run["evals"][str(s)][metric] for s in steps[1:])] for run in runs
            ]
            for metric in METRICS
        }
        seconds = [run["train_seconds"] for run in runs]
        arms[arm] = {
            "steps": steps,
            **{m: _spread(np.asarray(c, dtype=float)) for m, c in curves.items()},
            "train_seconds": {
                "mean": round(float(np.mean(seconds)), 1),
                "std": round(float(np.std(seconds)), 1),
            },
            "per_seed_final_f1": [round(c[-1], 4) for c in curves["f1"]],
        }
    final = {arm: arms[arm]["f1"]["mean"][-1] for arm in ARMS}
    return {
        "train_images": len(load_records(dataset.train_jsonl)),
        "report_images": len(report),
        "max_new_tokens": dataset.max_new_tokens,
        "stage1": stage1_eval,
        "arms": arms,
        "final_f1_minus_sft": {arm: round(final[arm] - final["sft"], 4) for arm in ARMS[1:]},
    }


def run_arm(
    dataset: Dataset, arm: str, seed: int, out: Path, report: list[Record], args: argparse.Namespace
) -> dict[str, Any]:
    """Train one arm for one seed (checkpoint every K steps), then evaluate every checkpoint."""

    def train_and_evaluate() -> dict[str, Any]:
        from rollmatch.training.entry import run_training

        if out.exists():
            shutil.rmtree(out)  # an interrupted run restarts from the stage-1 checkpoint
        cfg = arm_config(dataset, arm, seed, out, args)
        result = run_training(cfg)
        evals = {}
        for step in range(args.eval_every, args.steps + 1, args.eval_every):
            checkpoint = out / f"checkpoint-{step}"
            _copy_processor(dataset.stage1_dir, checkpoint)
            evals[str(step)] = evaluate(cfg, str(checkpoint), report, out / f"preds-{step}.jsonl")
        history = [h for h in result.log_history if "loss" in h]
        return {"train_seconds": round(result.seconds, 1), "evals": evals, "train_log": history}

    return cached(out.parent / f"seed{seed}.json", train_and_evaluate)


def arm_config(dataset: Dataset, arm: str, seed: int, out: Path, args: argparse.Namespace) -> RollmatchConfig:
    """The same optimisation for every arm; only the trainer variant differs."""
    config: dict[str, Any] = {
        "model": {"path": str(dataset.stage1_dir)},
        "data": {"train_jsonl": str(dataset.train_jsonl), "val_jsonl": None},
        "custom": {
            "trainer_variant": arm,
            "extra": {
                "rollout_matching": {
                    "rollout_backend": args.backend,
                    "max_new_tokens": dataset.max_new_tokens,
                    "vllm": {"tensor_parallel_size": 1, "enforce_eager": True},
                }
            },
        },
        "training": {
            "output_dir": str(out),
            "per_device_train_batch_size": 8,
            "packing": True,
            "global_max_length": dataset.max_length,
            "learning_rate": args.learning_rate,
            "lr_scheduler_type": "constant",
            "max_steps": args.steps,
            "save_steps": args.eval_every,
            "save_total_limit": None,
            "logging_steps": args.eval_every,
            "report_to": [],
            "seed": seed,
        },
        "eval": {"batch_size": 16},
    }
    if arm == "stage2_ab_training":
        config["stage2_ab"] = {
            "schedule": {"b_ratio": 0.5},
            # rollouts batched like rollout_matching_sft's (8 per call), so wall-clock compares fairly
            "channel_b": {"mode": "micro", "rollout_decode_batch_size": 8},
        }
    return load_config_dict(config, [], source="bench/learning_signal.py")


def evaluate(
    cfg: RollmatchConfig, model_dir: str, records: list[Record], predictions: Path
) -> dict[str, float]:
    """The report-split metrics of one model directory."""
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": model_dir})})
    result = run_eval(cfg, records, str(predictions))
    answers = [json.loads(line)["objects"] for line in predictions.read_text().splitlines()]
    n_pred = sum(len(objects) for objects in answers)
    n_gt = sum(len(r.objects) for r in records)
    tp = round(result.recall * n_gt)
    return {
        "f1": round(result.f1, 4),
        "map": round(result.map, 4),
        "tp": tp,
        "fp": n_pred - tp,
        "fn": n_gt - tp,
        "truncated_frac": round(result.truncated_frac, 4),
        "duplicate_rate": round(sum(duplicates(o) for o in answers) / n_pred, 4) if n_pred else 0.0,
        "objects_per_image": round(n_pred / len(records), 3),
        "eval_seconds": round(result.seconds, 1),
    }


def duplicates(objects: list[dict[str, Any]]) -> int:
    """Predicted objects repeating an earlier one of the same answer (same label, IoU >= 0.7)."""
    return sum(
        any(o["label"] == p["label"] and iou(o["bbox"], p["bbox"]) >= DUPLICATE_IOU for p in objects[:i])
        for i, o in enumerate(objects)
    )


# ---------------------------------------------------------------------------------------- output
def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("f1", "val F1 @ IoU 0.5"),
        ("truncated_frac", "truncated fraction"),
        ("duplicate_rate", "duplicate-object rate"),
    )
    datasets = result["datasets"]
    fig, axes = plt.subplots(len(datasets), len(panels), figsize=(13, 3.6 * len(datasets)), squeeze=False)
    colours = {"sft": "tab:grey", "rollout_matching_sft": "tab:orange", "stage2_ab_training": "tab:blue"}
    for row, (name, data) in enumerate(datasets.items()):
        for col, (metric, title) in enumerate(panels):
            ax = axes[row][col]
            for arm, values in data["arms"].items():
                mean, std = np.asarray(values[metric]["mean"]), np.asarray(values[metric]["std"])
                label = f"{arm} ({values['train_seconds']['mean']:.0f} s)"
                ax.plot(values["steps"], mean, marker="o", color=colours[arm], label=label)
                ax.fill_between(values["steps"], mean - std, mean + std, color=colours[arm], alpha=0.2)
            ax.set(title=f"{name}: {title}", xlabel="optimizer steps after stage-1")
            ax.set_ylim(0, max(0.1, ax.get_ylim()[1]))
            if col == 0:
                ax.legend(fontsize=8)
    fig.suptitle(
        f"learning signal, mean ± std over seeds {result['settings']['seeds']} ({result['date']}, {result['commit']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def cached(path: Path, compute: Any) -> Any:
    """``compute()`` once; its JSON is kept at ``path`` so an interrupted study resumes."""
    if path.exists():
        return json.loads(path.read_text())
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=1))
    return value


def _spread(curves: np.ndarray) -> dict[str, list[float]]:
    return {
        "mean": [round(float(v), 4) for v in curves.mean(axis=0)],
        "std": [round(float(v), 4) for v in curves.std(axis=0)],
        "min": [round(float(v), 4) for v in curves.min(axis=0)],
        "max": [round(float(v), 4) for v in curves.max(axis=0)],
    }


def _copy_processor(source: Path, checkpoint: Path) -> None:
    for name in _PROCESSOR_FILES:
        if (source / name).exists() and not (checkpoint / name).exists():
            shutil.copy(source / name, checkpoint / name)


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    main()
