"""Does training on its own rollouts beat more SFT on dense scenes? Pre-registered and powered.

``--preset`` picks the study (``bench/study_protocols.py``): ``crowd`` (the default, below; it stopped
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

    .venv/bin/python bench/dense_study.py --out runs/crowd --only-gate      # stage-1 + gate (~2 h)
    .venv/bin/python bench/dense_study.py --out runs/crowd --diagnose       # zero-training diagnostics
    .venv/bin/python bench/dense_study.py --out runs/crowd --pilot          # cost and spread (~1.5 h)
    .venv/bin/python bench/dense_study.py --out runs/crowd --docs           # every arm x seed
    .venv/bin/python bench/dense_study.py --out runs/crowd --summarize --docs   # from the units so far
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import rollmatch  # noqa: F401  (environment workarounds before transformers loads)
from rollmatch.config.load import load_config_dict
from rollmatch.config.schema import RollmatchConfig
from rollmatch.data.records import Record, load_records
from rollmatch.data.shapes import SHAPES_PRESETS
from rollmatch.errors import ConfigError

# grpo_signal imported now, not at the first gate: the process runs the code it started with
from studies import dense_summary, grpo_signal, shapes_recipe, study_rules, study_statistics, units
from studies.study_protocols import ARMS, CROWD_LOCKED, PROTOCOLS, TARGET_ARMS, StudyProtocol, next_rung

TRUNK_SAVE_STEPS = 100
PILOT = {"steps": 500, "eval_at": [250, 500], "seeds": [0], "arms": ["sft", *TARGET_ARMS]}
# Settings a crowd study folder is locked to (data, stage-1, arms' schedule); arms and seeds may grow.
# Each preset's protocol names its own (study_protocols.StudyProtocol.locked).
LOCKED = CROWD_LOCKED
# Smallest setting (tests/test_benches.py runs it; docs/runbook.md "Benchmarks"): a few images and
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the study folder (its units, JSON and PNG)")
    parser.add_argument(
        "--preset",
        choices=list(PROTOCOLS),
        default="crowd",
        help="the shapes preset, and with it the study's protocol (bench/study_protocols.py): its data "
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
    settings = lock_settings(out, args, protocol_of(args).locked)
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
    if result["arms"] or dense_summary.gate_points(result["gate"]):
        dense_summary.plot(result, out / "dense_study.png")
    if args.docs:
        docs_name = protocol_of(args).docs_name
        for suffix in (".json", ".png"):
            if (out / f"dense_study{suffix}").exists():
                shutil.copy(
                    out / f"dense_study{suffix}", Path(__file__).parents[1] / "docs" / f"{docs_name}{suffix}"
                )
    return result


def lock_settings(
    out: Path, args: argparse.Namespace, keys: tuple[str, ...] = LOCKED, what: str = "study"
) -> dict[str, Any]:
    """``out/settings.json`` holds ``keys`` of the first run; a rerun with other values is refused."""
    settings = {key: getattr(args, key) for key in keys}
    path = out / "settings.json"
    saved = json.loads(path.read_text()) if path.exists() else settings
    differing = sorted(key for key in keys if saved.get(key) != settings[key])
    if differing:
        raise SystemExit(f"{out} holds a {what} with other {differing} ({path}); use another --out")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=1))
    return settings


def prepare_data(out: Path, args: argparse.Namespace) -> dict[str, Path]:
    """train (stage-1's pool) / dev / report / arms (the arms' pool, when ``--arm-pool-size``) from
    generator seeds 0 / 1 / 2 / 3 of ``--preset``: each split its own stream."""
    sizes = {"train": args.train_size, "dev": args.dev_size, "report": args.report_size}
    if getattr(args, "arm_pool_size", 0):  # a crowd study's settings.json has no arm pool (and no preset)
        sizes["arms"] = args.arm_pool_size
    return shapes_recipe.generate_splits(out, sizes, SHAPES_PRESETS[protocol_of(args).preset])


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


# ---------------------------------------------------------------------------------------- configs
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
    save_steps = save_steps or min(args.eval_at)
    config["training"].update({"max_steps": steps, "learning_rate": args.lr, "save_steps": save_steps})
    if (folder / "trainer_state.json").exists() or any(folder.glob("checkpoint-*")):
        config["training"]["resume_from_checkpoint"] = "latest"
    try:
        return load_config_dict(config, [], source=f"bench/dense_study.py {arm}")
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
    return load_config_dict(config, [], source="bench/dense_study.py stage-1")


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


# ------------------------------------------------------------------------------------------ helpers
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


if __name__ == "__main__":
    main()
