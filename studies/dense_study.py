"""Does training on its own rollouts beat more SFT on dense scenes? Pre-registered and powered.

``--preset`` picks the study (``studies/study_protocols.py``): ``crowd`` (the default, below; it stopped
at its gate) or the medium study's rungs ``medium`` / ``medium_dense`` / ``medium_sparse`` (docs/runbook.md,
"Medium scenes: the pre-registered study": 4-12 objects of 32-56 px, a stage-1 pool, an arm pool
stage-1 never sees, dev and report, 8,000 stage-1 trunk steps in chunks of 2,000, a gate with a GRPO
clause, arms against ``sft_equal_compute``; ``--follow-ladder`` goes on to the next rung when the gate
says so). The crowd protocol, fixed before any arm ran (docs/runbook.md, "Crowded scenes: the
pre-registered study"; the numbers live in ``bench/study_rules.py``):

- **Data**: ``rollmatch data shapes --preset crowd`` (8-30 objects of 16-32 px, a third of the images
  with a tied row); train 4,000, dev 300, report 600 images, each split its own generator stream
  (seeds 0, 1, 2); coordinate tokens. A crowd object is 25 tokens (4 coordinate tokens, the label
  spelt out), so a 30-object list is 752 tokens; ``--max-new-tokens 1024`` leaves room for 10 more
  objects (duplicates), so truncation is measured, not forced.
- **Stage-1**: a tiny Qwen3-VL (text rope theta 10, init seed ``--stage1-seed``), SFT at 2e-3 on a
  constant trunk, in chunks of ``--stage1-chunk`` steps (a checkpoint at each). After each chunk a
  cool-down branch (15% of the branch's steps, linear to the arms' learning rate) gives the
  checkpoint the gate sees; stage-1 is extended chunk by chunk until the gate passes, up to
  ``--stage1-max-steps``. Interrupted, it resumes from the newest checkpoint.
- **Gate** on dev, before any arm: label-aware F1@0.5 in [0.45, 0.85]; room for the mechanism:
  count-oracle headroom >= 0.04 (the F1 if every image's count error were fixed, minus the F1), or
  duplicate rate >= 2%, or recall at 26-30 objects at least 0.10 below recall at 8-12; and every
  rollout target (``--gate-targets``) differing from SFT's in token ids on >= 25% of dev records.
  F1 below the range extends stage-1; above it, or in range without room, the study stops and says
  that the mechanism is absent in this model class on this data.
- **Arms** from the gated checkpoint, 1,000 steps, lr 2e-4 (HF ``constant``: no warm-up), the same
  records per seed, greedy evaluation always (``eval.decoding``): ``sft``; ``prefix_fn_supervised``;
  ``keep_all_supervised`` (trains after its own mistakes); ``keep_all_supervised_fp_unlikelihood``
  (``loss.fp_unlikelihood_weight`` 0.5); ``keep_all_supervised_sampled_k4`` (temperature 0.7, K = 4
  rollouts per record); ``grpo_f1_k4`` (F1 reward, K = 4, temperature 0.7); and ``sft_equal_compute``:
  SFT continued to **each arm's own** cost (CPU seconds per step of its cheapest seed), one SFT run
  per seed evaluated at every arm's step count.
- **Seeds and power**: 5 seeds x 600 report images; 8 seeds if the pilot's spread of the paired
  difference exceeds 0.012. **Primary**: overall F1@0.5 minus ``sft``'s at 1,000 steps, paired
  bootstrap over seeds x images, with a per-seed paired t-test. **Secondary**: F1 and recall per
  GT-count bucket, count error and MAE, last-third recall, duplicates, Kendall tau, count-oracle F1.
  **Decision rule**: a gain is +0.02 overall with the 95% interval above 0, or +0.04 in the 26-30
  bucket with its interval above 0 and the bucket differences rising monotonely from 8-12 to 26-30;
  no verdict on fewer than 5 seeds; a gain is replicated on a second stage-1 seed
  (``--stage1-seed 1``, another ``--out``; ``--replication``) before the README claims it.
- The default target is chosen on dev (``default_target_on_dev``), never on report. Every unit file
  records the code commit, the config and the decoding that produced it.

Every unit (a stage-1 chunk and its gate, each arm x seed, each evaluation, each equal-compute point)
writes its own JSON under ``--out``; a rerun skips what is done. Prints ONE JSON object (also
``--out/dense_study.json``) and a PNG (F1 and recall per GT-count bucket per arm); ``--docs`` copies both
into docs/. Run (16-20 hours of 2 cores in all; stop and rerun at will)::

    .venv/bin/python -m studies.dense_study --out runs/crowd --only-gate      # stage-1 + gate (~2 h)
    .venv/bin/python -m studies.dense_study --out runs/crowd --diagnose       # zero-training diagnostics
    .venv/bin/python -m studies.dense_study --out runs/crowd --pilot          # cost and spread (~1.5 h)
    .venv/bin/python -m studies.dense_study --out runs/crowd --docs           # every arm x seed
    .venv/bin/python -m studies.dense_study --out runs/crowd --summarize --docs   # from the units so far
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import rollmatch  # noqa: F401  (environment workarounds before transformers loads)
from studies import dense_plot, dense_summary, shapes_recipe, study_rules, units
from studies.dense_arms import (
    arm_config,
    code_commit,
    evaluation,
    prepare_data,
    protocol_of,
    require_arms,
    run_arm,
)
from studies.dense_gate import diagnose, stage1_and_gate
from studies.study_protocols import ARMS, PROTOCOLS, TARGET_ARMS

PILOT = {"steps": 500, "eval_at": [250, 500], "seeds": [0], "arms": ["sft", *TARGET_ARMS]}
# Smallest setting (tests/studies/test_study_smoke.py runs it; docs/runbook.md "Benchmarks"): a few images and
# steps, one seed, the sft arm only; a 2-step stage-1 fails the gate, hence --ignore-gate.
SMOKE_ARGS = (
    "--out {tmp}/dense_study --train-size 8 --dev-size 4 --report-size 4 --stage1-chunk 2 "
    "--stage1-max-steps 2 --steps 2 --eval-at 2 --seeds 0 --arms sft --gate-targets prefix_fn_supervised "
    "--max-new-tokens 16 --backend hf --bootstrap 10 --ignore-gate"
)
SMOKE_KEYS = ("settings", "data", "gate", "arms", "comparisons", "missing")


def main() -> None:
    args = parse_args()
    with contextlib.redirect_stdout(sys.stderr):  # the trainer prints its logs; stdout is the JSON alone
        result = run_study(args)
        while args.follow_ladder and not args.summarize and (rung := result["gate"].get("next_rung")):
            print(f"the gate moved the ladder to {rung['preset']}: {rung['out']}", file=sys.stderr)
            args = parse_args(ladder_argv(args.argv, rung["preset"], rung["out"]))
            result = run_study(args)
    print(json.dumps(result))


def ladder_argv(argv: list[str], preset: str, out: str) -> list[str]:
    """The same command on the next rung: ``--preset`` and ``--out`` replaced, every other flag kept."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--preset", "--out"):
            skip = True
        elif not arg.startswith(("--preset=", "--out=")):
            kept.append(arg)
    return ["--out", out, "--preset", preset, *kept]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m studies.dense_study", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", required=True, help="the study folder (its units, JSON and PNG)")
    parser.add_argument(
        "--preset",
        choices=list(PROTOCOLS),
        default="crowd",
        help="the shapes preset, and with it the study's protocol (studies/study_protocols.py): its data "
        "sizes, stage-1 budget, buckets, gate and arms are the defaults below",
    )
    parser.add_argument("--train-size", type=int, help="the stage-1 pool (crowd: 4,000; medium: 16,000)")
    parser.add_argument(
        "--arm-pool-size",
        type=int,
        help="images the arms train on, a pool stage-1 never sees (0: the stage-1 pool; medium: 4,800)",
    )
    parser.add_argument("--dev-size", type=int)
    parser.add_argument("--report-size", type=int, help="crowd: 600; medium: 1,000")
    parser.add_argument("--object-format", choices=["coord_tokens", "qwen_json"], default="coord_tokens")
    parser.add_argument(
        "--max-new-tokens", type=int, help="crowd: 1,024 (a 30-object list is 752 tokens); medium: 512"
    )
    parser.add_argument("--stage1-lr", type=float, default=2e-3)
    parser.add_argument("--stage1-chunk", type=int, help="stage-1 trunk steps per extension")
    parser.add_argument("--stage1-max-steps", type=int, help="trunk steps at most")
    parser.add_argument(
        "--stage1-seed", type=int, default=0, help="stage-1 init and data order (replication)"
    )
    parser.add_argument("--lr", type=float, help="every arm's (HF constant schedule)")
    parser.add_argument("--steps", type=int, help="optimizer steps per arm and seed")
    parser.add_argument("--eval-at", type=int, nargs="+", help="dev evals; report at the last")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(study_rules.SEEDS)))
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), help="default: the preset's protocol's")
    parser.add_argument("--gate-targets", nargs="+", choices=TARGET_ARMS, help="default: the protocol's")
    parser.add_argument("--equal-compute-grain", type=int, default=50, help="SFT steps between checkpoints")
    parser.add_argument("--backend", choices=["hf", "vllm"], default=units.default_backend())
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--only-gate", action="store_true", help="stop after stage-1 and the gate")
    mode.add_argument(
        "--diagnose", action="store_true", help="stage-1, gate, then `rollmatch diagnose` on dev"
    )
    mode.add_argument("--pilot", action="store_true", help=f"the pilot: {PILOT} (dev only)")
    mode.add_argument(
        "--summarize", action="store_true", help="the JSON and PNG from the units done; run nothing"
    )
    parser.add_argument(
        "--ignore-gate", action="store_true", help="run arms after a failed gate (smoke runs)"
    )
    parser.add_argument("--replication", help="the same study with another --stage1-seed (its --out)")
    parser.add_argument("--docs", action="store_true", help="copy the JSON and PNG into docs/")
    parser.add_argument(
        "--follow-ladder",
        action="store_true",
        help="when the gate's decision moves the ladder (study_protocols.next_rung), go on with the same "
        "mode on the next rung, in the folder beside --out named after its preset",
    )
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    protocol = PROTOCOLS[args.preset]
    defaults = {
        **protocol.defaults,
        "arms": list(protocol.arms),
        "gate_targets": list(protocol.gate_targets),
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if max(args.eval_at) != args.steps:
        parser.error("--eval-at must end at --steps (the report evaluation)")
    return args


def run_study(args: argparse.Namespace) -> dict[str, Any]:
    """Every unit the mode asks for that is not done yet, then the summary of every unit done."""
    started = time.perf_counter()
    code_commit()  # the commit every unit of this process records
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    settings = units.lock_settings(out, args, protocol_of(args).locked)
    splits = prepare_data(out, args)
    if not args.summarize:
        crowd_pilot = args.pilot and not protocol_of(args).lr_pair
        arms = [] if args.only_gate or args.diagnose else PILOT["arms"] if crowd_pilot else args.arms
        grpo_arm = ["grpo_f1_k4"] if protocol_of(args).grpo_gate else []  # the gate's GRPO clause
        require_arms([*args.gate_targets, *grpo_arm, *arms])  # before hours of stage-1
        gate = stage1_and_gate(out, splits, args)
        if not (gate["passed"] or args.ignore_gate or args.only_gate):
            readings = study_rules.stop_readings(protocol_of(args))
            print(
                f"the gate decided {gate['decision']} at {gate['trunk_steps']} trunk steps (dev F1 "
                f"{gate['f1']}): {readings[gate['decision']]}. The study stops there; "
                "--ignore-gate runs the arms anyway (outside the protocol)",
                file=sys.stderr,
            )
        if gate["passed"] or args.ignore_gate:
            stage1 = Path(gate["checkpoint"])
            if args.diagnose:
                units.cached(out / "diagnostics.json", lambda: diagnose(out, stage1, splits, args))
            elif args.pilot and protocol_of(args).lr_pair:
                run_lr_pilot(out, stage1, splits, args)
            elif args.pilot:
                for arm in PILOT["arms"]:
                    run_arm(out / "pilot", arm, 0, stage1, splits, args, PILOT["steps"], PILOT["eval_at"], [])
            elif not args.only_gate:
                arm_args = learning_rates(out, args)
                for seed in args.seeds:
                    for arm in args.arms:
                        run_arm(
                            out,
                            arm,
                            seed,
                            stage1,
                            splits,
                            arm_args[arm],
                            args.steps,
                            args.eval_at,
                            [args.steps],
                        )
                if "sft" in args.arms and len(args.arms) > 1:
                    run_equal_compute(out, stage1, splits, arm_args["sft"])
    result = dense_summary.summarize(
        out, args, settings, shapes_recipe.data_summary(splits), list(ARMS), PILOT
    )
    result.update(command="python -m studies.dense_study " + " ".join(args.argv), commit=code_commit())
    result["seconds_this_invocation"] = round(time.perf_counter() - started, 1)
    (out / "dense_study.json").write_text(json.dumps(result, indent=1))
    if result["arms"] or dense_plot.gate_points(result["gate"]):
        dense_plot.plot(result, out / "dense_study.png")
    if args.docs:
        docs_name = protocol_of(args).docs_name
        for suffix in (".json", ".png"):
            if (out / f"dense_study{suffix}").exists():
                shutil.copy(
                    out / f"dense_study{suffix}", Path(__file__).parents[1] / "docs" / f"{docs_name}{suffix}"
                )
    return result


# ----------------------------------------------------------------------- the pilot, equal compute
def run_lr_pilot(out: Path, stage1: Path, splits: dict[str, Path], args: argparse.Namespace) -> None:
    """The pilot of a protocol with a learning-rate pair (the medium study): every arm at each rate of the
    pair, seed 0, ``pilot_steps`` steps, dev only (``pilot/lr<rate>/arms/<arm>/seed0.json``); each arm
    keeps the rate with the higher dev F1 (``pilot/lr_chosen.json``); then SFT at the chosen rate to
    each rollout arm's equal compute, on dev: the spread of the paired difference the seeds follow."""
    protocol = protocol_of(args)
    steps = protocol.pilot_steps
    runs: dict[str, dict[float, Any]] = {}
    for lr in protocol.lr_pair:
        lr_args = argparse.Namespace(**{**vars(args), "lr": lr, "steps": steps, "eval_at": [steps]})
        for arm in args.arms:
            folder = out / "pilot" / f"lr{lr:g}"
            runs.setdefault(arm, {})[lr] = run_arm(
                folder, arm, 0, stage1, splits, lr_args, steps, [steps], []
            )
    dev_f1 = {
        arm: {lr: run["evals"][str(steps)]["dev"]["f1"] for lr, run in by_lr.items()}
        for arm, by_lr in runs.items()
    }
    chosen = units.cached(out / "pilot" / "lr_chosen.json", lambda: study_rules.choose_learning_rates(dev_f1))
    if "sft" in args.arms and len(args.arms) > 1:
        best = {arm: {0: runs[arm][chosen[arm]]} for arm in args.arms}
        sft_args = argparse.Namespace(**{**vars(args), "lr": chosen["sft"], "steps": steps, "seeds": [0]})
        run_equal_compute(out / "pilot", stage1, splits, sft_args, best, "dev")


def learning_rates(out: Path, args: argparse.Namespace) -> dict[str, argparse.Namespace]:
    """Each arm's arguments with its learning rate: ``--lr`` (crowd), or the pilot's choice (medium)."""
    if not protocol_of(args).lr_pair:
        return dict.fromkeys([*args.arms, "sft"], args)
    path = out / "pilot" / "lr_chosen.json"
    chosen = json.loads(path.read_text()) if path.exists() else {}
    missing = sorted({*args.arms, "sft"} - set(chosen))
    if missing:
        raise SystemExit(
            f"{missing}: no learning rate chosen by the pilot ({path}); run the same command with --pilot "
            "first (it picks each arm's rate from the protocol's pair on dev)"
        )
    return {arm: argparse.Namespace(**{**vars(args), "lr": chosen[arm]}) for arm in {*args.arms, "sft"}}


def run_equal_compute(
    out: Path,
    stage1: Path,
    splits: dict[str, Path],
    args: argparse.Namespace,
    runs: dict[str, dict[int, Any]] | None = None,
    split: str = "report",
) -> None:
    """One SFT run per seed, continued through every arm's equal-compute step count (each arm's own cost
    per step, from its cheapest seed, in ``runs``; default the arms under ``out``), evaluated on
    ``split`` at each."""
    from rollmatch.training.entry import run_training

    runs = runs or {arm: units.arm_runs(out, arm) for arm in args.arms}
    costs = dense_summary.cost_per_step(runs)
    basis = costs.pop("basis")
    rollout_arms = [arm for arm in args.arms if arm != "sft"]
    folder = out / "arms" / "sft_equal_compute"
    steps_by_arm = {
        arm: units.cached(
            folder / f"steps-{arm}.json",
            lambda arm=arm: {
                "steps": study_rules.equal_compute_steps_by_arm(
                    {arm: costs[arm]}, costs["sft"], args.steps, args.equal_compute_grain
                )[arm],
                "compute_basis": basis,
                "arm_over_sft_cost_per_step": round(costs[arm] / costs["sft"], 3),
            },
        )["steps"]
        for arm in rollout_arms
    }
    for seed in args.seeds:
        run_dir = folder / f"seed{seed}"
        for target in sorted(set(steps_by_arm.values())):
            at = run_dir / f"at-{target}"
            cfg = arm_config(run_dir, "sft", seed, stage1, splits, args, target)
            if not (at / "config.json").exists():
                grain = args.equal_compute_grain
                training = {"save_steps": grain, "save_total_limit": 2}
                cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update=training)})
                run_training(cfg)
                shutil.copytree(run_dir / "final", at, dirs_exist_ok=True)
            evaluation(cfg, at, stage1, splits, split, run_dir, target, args.preset)


if __name__ == "__main__":
    main()
