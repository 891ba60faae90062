"""The dense study's data and arms: its splits, each arm's config, one arm x seed trained and evaluated as a unit, and what
every unit file records.

Owns: :func:`prepare_data` (the preset's splits, each its own generator stream), :func:`protocol_of`
(the preset's ``StudyProtocol``), :func:`study_config` (the shapes recipe's
base config with the protocol's GT-count buckets), :func:`arm_config` (an arm of
``study_protocols.ARMS``: its variant, loss and rollouts, refused with what it needs when this code
lacks its keys; :func:`require_arms` checks them all before hours of stage-1), :func:`sft_config`
(stage-1's), :func:`run_arm` and :func:`evaluation` (cached units), :func:`provenance` and
:func:`code_commit`.

Leaves out: stage-1 and the gate (``studies/dense_gate.py``), the order units run in
(``studies/dense_study.py``), the summary (``studies/dense_summary.py``).
"""

from __future__ import annotations

import argparse
import functools
import subprocess
from pathlib import Path
from typing import Any

from rollmatch.config.load import load_config_dict
from rollmatch.config.schema import RollmatchConfig
from rollmatch.data.records import load_records
from rollmatch.data.shapes import SHAPES_PRESETS
from rollmatch.errors import ConfigError
from studies import shapes_recipe, study_statistics, units
from studies.study_protocols import ARMS, PROTOCOLS, StudyProtocol


# ------------------------------------------------------------------------------------------- data
def prepare_data(out: Path, args: argparse.Namespace) -> dict[str, Path]:
    """train (stage-1's pool) / dev / report / arms (the arms' pool, when ``--arm-pool-size``) from
    generator seeds 0 / 1 / 2 / 3 of ``--preset``: each split its own stream."""
    sizes = {"train": args.train_size, "dev": args.dev_size, "report": args.report_size}
    if getattr(args, "arm_pool_size", 0):  # a crowd study's settings.json has no arm pool (and no preset)
        sizes["arms"] = args.arm_pool_size
    return shapes_recipe.generate_splits(out, sizes, SHAPES_PRESETS[protocol_of(args).preset])


# ---------------------------------------------------------------------------------------- configs
def protocol_of(args: argparse.Namespace) -> StudyProtocol:
    return PROTOCOLS[getattr(args, "preset", "crowd")]


def study_config(
    folder: Path, model: Path, splits: dict[str, Path], args: argparse.Namespace, *, seed: int
) -> dict[str, Any]:
    """``learning_signal.base_config`` with the protocol's GT-count buckets in every evaluation."""
    config = shapes_recipe.base_config(folder, str(model), splits, args, seed=seed)
    edges = protocol_of(args).count_buckets
    if edges is not None:
        config["eval"]["count_buckets"] = list(edges)
    return config


def arm_config(
    folder: Path,
    arm: str,
    seed: int,
    model: Path,
    splits: dict[str, Path],
    args: argparse.Namespace,
    steps: int,
    save_steps: int | None = None,
) -> RollmatchConfig:
    """One arm: the same records (seed) and learning rate; only the variant, loss and rollouts differ.
    A checkpoint every ``save_steps`` (default: the first of ``--eval-at``)."""
    spec = ARMS[arm]
    arm_splits = {**splits, "train": splits["arms"]} if "arms" in splits else splits  # stage-1 never saw it
    config = study_config(folder, model, arm_splits, args, seed=seed)
    config["custom"]["trainer_variant"] = spec["variant"]
    config["preflight"] = {"records": 0}  # every arm starts from the one gated stage-1 model
    config["custom"]["extra"]["rollout_matching"].update(spec.get("rollout", {}))
    config["loss"] = spec["loss"]
    if "noise_objects" in spec["loss"]:  # Pix2Seq pads to the largest object count: the preset's
        max_objects = SHAPES_PRESETS[protocol_of(args).preset].max_objects
        config["loss"] = {
            **spec["loss"],
            "noise_objects": {**spec["loss"]["noise_objects"], "pad_to": max_objects},
        }
    save_steps = save_steps or min(args.eval_at)
    config["training"].update({"max_steps": steps, "learning_rate": args.lr, "save_steps": save_steps})
    if (folder / "trainer_state.json").exists() or any(folder.glob("checkpoint-*")):
        config["training"]["resume_from_checkpoint"] = "latest"
    try:
        return load_config_dict(config, [], source=f"studies/dense_study.py {arm}")
    except ConfigError as error:
        needs = spec.get("needs", "nothing beyond this code")
        raise SystemExit(
            f"arm {arm} needs {needs}; this code refuses its config:\n{error}\nMerge the change that adds "
            "those keys, or leave the arm out (--arms / --gate-targets)"
        ) from error


def require_arms(arms: list[str]) -> None:
    """Fail at once, before hours of stage-1, when an arm's config keys are not in this code."""
    for arm in dict.fromkeys(arms):
        arm_config(
            Path("/nonexistent/check"), arm, 0, Path("/nonexistent/model"), {"train": Path("x")}, _CHECK, 1
        )


_CHECK = argparse.Namespace(
    object_format="coord_tokens", backend="hf", max_new_tokens=8, lr=1e-4, eval_at=[1]
)


def sft_config(folder: Path, model: Path, splits: dict[str, Path], args: argparse.Namespace, **training: Any):
    config = study_config(folder, model, splits, args, seed=args.stage1_seed)
    config["training"].update(training)
    if any(folder.glob("checkpoint-*/rollmatch_complete.json")):
        config["training"]["resume_from_checkpoint"] = "latest"
    return load_config_dict(config, [], source="studies/dense_study.py stage-1")


# ------------------------------------------------------------------------------------------- arms
def run_arm(
    root: Path,
    arm: str,
    seed: int,
    stage1: Path,
    splits: dict[str, Path],
    args: argparse.Namespace,
    steps: int,
    eval_at: list[int],
    report_at: list[int],
) -> dict[str, Any]:
    """Train (resuming an interrupted run), then evaluate: dev at ``eval_at``, report at ``report_at``."""
    folder = root / "arms" / arm / f"seed{seed}"

    def train_and_evaluate() -> dict[str, Any]:
        cfg = arm_config(folder, arm, seed, stage1, splits, args, steps, min(eval_at))
        seconds, cpu_seconds = units.train_with_cost(cfg, folder, steps)
        evals = {}
        for step in eval_at:
            checkpoint = folder / "final" if step == steps else folder / f"checkpoint-{step}"
            splits_here = ["dev", "report"] if step in report_at else ["dev"]
            evals[str(step)] = {
                split: evaluation(cfg, checkpoint, stage1, splits, split, folder, step, args.preset)
                for split in splits_here
            }
        return {
            "steps": steps,
            "train_seconds": round(seconds, 1),
            "train_cpu_seconds": None if cpu_seconds is None else round(cpu_seconds, 1),
            "evals": evals,
            **provenance(cfg, args.preset),
        }

    return units.cached(root / "arms" / arm / f"seed{seed}.json", train_and_evaluate)


def evaluation(
    cfg: RollmatchConfig,
    checkpoint: Path,
    stage1: Path,
    splits: dict[str, Path],
    split: str,
    folder: Path,
    step: int,
    preset: str = "crowd",
) -> dict[str, Any]:
    """One cached evaluation unit: greedy (``eval.decoding``), study matching, per-image counts."""
    units.copy_processor(stage1, checkpoint)

    def compute() -> dict[str, Any]:
        result = units.evaluate(
            cfg, str(checkpoint), load_records(splits[split]), folder / f"preds-{step}-{split}.jsonl"
        )
        result["count_oracle"] = study_statistics.count_oracle_headroom(result["per_image"])
        return {**result, **provenance(cfg, preset)}

    return units.cached(folder / f"eval-{step}-{split}.json", compute)


# ------------------------------------------------------------------------------------- provenance
def provenance(cfg: RollmatchConfig, preset: str) -> dict[str, Any]:
    """What every unit file records: the code commit, the config, the evaluation decoding, the preset."""
    return {
        "commit": code_commit(),
        "config": cfg.model_dump(mode="json"),
        "eval_decoding": cfg.eval.decoding.model_dump(),
        "preset": preset,
    }


@functools.cache
def code_commit() -> str:
    """``git rev-parse --short HEAD``, with ``+dirty`` when tracked files differ from it, read once: the
    commit this process started from (a study runs for hours while the checkout may move on)."""
    try:
        git = {"capture_output": True, "text": True, "timeout": 10, "cwd": Path(__file__).parents[1]}
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=True, **git)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], **git)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
