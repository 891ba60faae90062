"""The dense study's stage-1 and its gate: stage-1 trained chunk by chunk, each chunk's cool-down branch
read by the gate, until the gate decides; and the zero-training diagnostics of the gated checkpoint.

Owns: :func:`stage1_and_gate` (extend, pass or stop, by ``study_rules.stage1_next``; a decided gate
names the ladder's next rung), :func:`gate_at` (one chunk: trunk, cool-down, dev evaluation, the
rollout-target reading and, for the medium protocol, :func:`grpo_sampling`), :func:`diagnose`.

Leaves out: the gate's thresholds and verdict (``studies/study_rules.py``), the arms' configs
(``studies/dense_arms.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path
from typing import Any

from rollmatch.data.records import Record, load_records

# grpo_signal imported now, not at the first gate: the process runs the code it started with
from studies import grpo_signal, shapes_recipe, study_rules, units
from studies.dense_arms import arm_config, protocol_of, provenance, sft_config
from studies.study_protocols import next_rung

TRUNK_SAVE_STEPS = 100


# ---------------------------------------------------------------------------------- stage-1, gate
def stage1_and_gate(out: Path, splits: dict[str, Path], args: argparse.Namespace) -> dict[str, Any]:
    """Extend stage-1 chunk by chunk until the gate decides (``study_rules.stage1_next``)."""
    if (out / "gate.json").exists():
        return json.loads((out / "gate.json").read_text())
    trunk, history = args.stage1_chunk, []
    while True:
        gate = units.cached(
            out / "stage1" / f"gate-{trunk}.json", lambda t=trunk: gate_at(out, splits, args, t)
        )
        decision = study_rules.stage1_next(gate, trunk, args.stage1_max_steps)
        history.append(
            {"trunk_steps": trunk, "decision": decision, "f1": gate["f1"], "passed": gate["passed"]}
        )
        if decision != "extend":
            break
        trunk += args.stage1_chunk

    def decided() -> dict[str, Any]:
        final = {**gate, "decision": decision, "history": history}
        rung = next_rung(protocol_of(args), final)
        if rung is not None:
            final["next_rung"] = {"preset": rung, "out": str(out.parent / rung)}
        return final

    return units.cached(out / "gate.json", decided)


def gate_at(out: Path, splits: dict[str, Path], args: argparse.Namespace, trunk: int) -> dict[str, Any]:
    from rollmatch.models.tiny import TinySize, build_tiny_model
    from rollmatch.training.entry import run_training

    model = out / "model"
    if not (model / "config.json").exists():
        coord = args.object_format == "coord_tokens"
        build_tiny_model(
            "qwen3_vl", model, seed=args.stage1_seed, size=TinySize(rope_theta=10.0), coord_tokens=coord
        )
    warmup = max(0, min(100, args.stage1_chunk // 10))  # steps, on the first chunk only
    trunk_dir = out / "stage1" / "trunk"
    if not (trunk_dir / f"checkpoint-{trunk}" / "rollmatch_complete.json").exists():
        run_training(
            sft_config(
                trunk_dir,
                model,
                splits,
                args,
                max_steps=trunk,
                learning_rate=args.stage1_lr,
                # a checkpoint every TRUNK_SAVE_STEPS too: an interrupted chunk resumes close to where it stopped
                save_steps=math.gcd(args.stage1_chunk, TRUNK_SAVE_STEPS),
                lr_scheduler_type="constant_with_warmup",
                warmup_ratio=warmup / trunk,
                save_total_limit=None,
            )
        )
    cooldown = max(1, round(0.15 / 0.85 * trunk))  # 15% of the branch's steps
    branch = out / "stage1" / f"cooldown-{trunk}"
    if not (branch / "final" / "config.json").exists():
        if not any(branch.glob("checkpoint-*/rollmatch_complete.json")):
            shutil.copytree(
                trunk_dir / f"checkpoint-{trunk}", branch / f"checkpoint-{trunk}", dirs_exist_ok=True
            )
        run_training(
            sft_config(
                branch,
                model,
                splits,
                args,
                max_steps=trunk + cooldown,
                learning_rate=args.stage1_lr,
                save_steps=cooldown,
                warmup_ratio=warmup / (trunk + cooldown),
                lr_scheduler_type="warmup_stable_decay",
                lr_scheduler_kwargs={
                    "num_decay_steps": cooldown,
                    "decay_type": "linear",
                    "min_lr_ratio": args.lr / args.stage1_lr,
                },
            )
        )
    stage1 = branch / "final"
    cfg = sft_config(out / "gate", stage1, splits, args)
    dev = load_records(splits["dev"])
    predictions = out / "stage1" / f"gate-{trunk}.predictions.jsonl"
    evaluation = units.evaluate(cfg, str(stage1), dev, predictions)
    reading = targets_reading(stage1, splits, args, dev, predictions)
    protocol = protocol_of(args)
    grpo = None
    if protocol.grpo_gate is not None:
        grpo = units.cached(
            out / "stage1" / f"gate-{trunk}.grpo_sampling.json",
            lambda: grpo_sampling(out / "gate", stage1, splits, args, dev),
        )
    differs = {name: r["differs"] for name, r in reading.items()}
    verdict = study_rules.gate_verdict(evaluation, differs, protocol, grpo)
    return {
        **verdict,
        "targets_keeping_own_elements": {name: r["keeps_own"] for name, r in reading.items()},
        "trunk_steps": trunk,
        "cooldown_steps": cooldown,
        "checkpoint": str(stage1),
        "dev": evaluation,
        **provenance(cfg, args.preset),
    }


def targets_reading(
    stage1: Path, splits: dict[str, Path], args: argparse.Namespace, dev: list[Record], predictions: Path
) -> dict[str, dict[str, float]]:
    """Per target (each of ``--gate-targets``, built from stage-1's greedy answer with the arm's own
    loss settings): the share of dev records whose target holds other token ids than the SFT target
    (weights do not count) and the share whose target keeps any of the answer's own elements."""
    losses = {
        arm: arm_config(stage1, arm, 0, stage1, splits, args, args.steps).loss for arm in args.gate_targets
    }
    cfg = sft_config(stage1.parent, stage1, splits, args)
    return shapes_recipe.target_reading(cfg, stage1, dev, predictions, losses)


def grpo_sampling(
    folder: Path, stage1: Path, splits: dict[str, Path], args: argparse.Namespace, dev: list[Record]
) -> dict[str, Any]:
    """The GRPO clause's reading: K rollouts per dev record at the GRPO arm's temperature, scored by
    the GRPO objective's own reward (``grpo_signal.sampled_rewards``): the share of groups with zero
    reward spread and of malformed rollouts."""
    gate = protocol_of(args).grpo_gate
    assert gate is not None
    cfg = arm_config(folder, "grpo_f1_k4", 0, stage1, splits, args, args.steps)
    rollout = cfg.custom.extra.rollout_matching
    if (
        rollout.rollouts_per_record != gate.rollouts_per_record
        or rollout.decoding.temperature != gate.temperature
    ):
        raise SystemExit(
            f"the GRPO arm samples K = {rollout.rollouts_per_record} at temperature "
            f"{rollout.decoding.temperature}, the gate's clause K = {gate.rollouts_per_record} at "
            f"{gate.temperature}: make ARMS['grpo_f1_k4'] and study_protocols.GrpoGate agree"
        )
    reading = grpo_signal.sampled_rewards(cfg, dev, gate.rollouts_per_record, seed=0)
    return {**{k: v for k, v in reading.items() if k != "per_image"}, **provenance(cfg, args.preset)}


def diagnose(out: Path, stage1: Path, splits: dict[str, Path], args: argparse.Namespace) -> dict[str, Any]:
    """``rollmatch diagnose`` on dev: token-id differences of every target to SFT's, prefix sensitivity."""
    try:
        from rollmatch.diagnostics import run_diagnose  # type: ignore[import-not-found]
    except ImportError as error:
        raise SystemExit(
            "--diagnose needs `rollmatch diagnose` (rollmatch/diagnostics.py: run_diagnose(cfg, records, "
            f"prefix_ks)), which this code lacks ({error}); merge it first"
        ) from error
    cfg = sft_config(out / "diagnostics", stage1, splits, args)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(stage1)})})
    return {**run_diagnose(cfg, load_records(splits["dev"]), [1, 2, 4]), **provenance(cfg, args.preset)}
