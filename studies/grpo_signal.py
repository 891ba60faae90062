"""Does GRPO raise the detection reward? Mean sampled reward before and after N GRPO steps, paired over images.

Design (docs/runbook.md, "GRPO"):

- **Stage-1**: the demo's (``rollmatch demo``: tiny Qwen2.5-VL with coordinate tokens, the demo shapes
  set, 2,400 SFT steps), trained into ``--out/sft`` or taken from ``--stage1`` (e.g. ``runs/demo/sft/final``).
- **Reward**: on ``--images`` val images, ``--reward-rollouts`` K samples per image at ``--temperature`` with
  fixed seeds (the same seeds before and after), each scored by the GRPO objective's own reward
  (``training.grpo_targets.GrpoGroups``: ``loss.grpo`` settings, the same parse, match and floor); an
  image's reward is the mean of its K. Rollouts come from the backend the demo uses (vLLM colocated when
  installed, else HF generate).
- **GRPO**: ``--steps`` optimizer steps from stage-1 (``loss.objective: grpo``, ``--records-per-step``
  records x ``--rollouts`` samples at ``--temperature`` (default 1), learning rate ``--lr``, HF ``constant`` schedule),
  ``grpo/reward_mean`` logged every step.
- **Statistics**, fixed before the run: paired bootstrap over images of the per-image mean reward
  difference (after - before); the objective *works* when the 95% interval is above 0 and the greedy
  label-aware F1@0.5 after is not lower than before by more than ``F1_SLACK`` (truncated fraction and
  invalid counts reported beside it).

Every unit (stage-1, each reward measurement, each evaluation, the GRPO run) writes its own JSON under
``--out``; a rerun skips what is done. Prints ONE JSON object (also ``--out/grpo_signal.json``). Run
(about 15 min on an idle 2-core machine, stage-1 ~4 of them; on a loaded one a GRPO step whose
16 rollouts all run to 160 tokens took 16 s, 32 reward samples 14 s)::

    .venv/bin/python -m studies.grpo_signal --out runs/grpo_signal
    .venv/bin/python -m studies.grpo_signal --out runs/grpo_signal --stage1 runs/demo/sft/final  # reuse
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

import rollmatch  # noqa: F401  (environment workarounds before transformers loads)
from rollmatch.config.load import deep_merge
from rollmatch.config.schema import RollmatchConfig
from rollmatch.data.records import Record, load_records
from rollmatch.demo import (
    ROLLOUT_PHASE,
    SFT_PHASE,
    SHAPES,
    build_inputs,
    default_backend,
    eval_summary,
    phase_config,
    with_model,
)
from rollmatch.evaluation import run_eval
from studies import units
from studies.study_statistics import paired_mean_bootstrap

F1_SLACK = 0.05  # decided before the run: "F1 does not collapse" = at most this much lower after GRPO
CURVE_ENDS = 10  # grpo/reward_mean: mean of the first and of the last this many logged steps
_RM = "custom.extra.rollout_matching"
# Smallest setting (tests/studies/test_study_smoke.py, tests/studies/test_grpo_signal.py): a few images, 2 GRPO steps.
SMOKE_ARGS = (
    "--out {tmp}/grpo_signal --train-images 8 --images 2 --stage1-steps 2 --steps 2 --records-per-step 1 "
    "--rollouts 2 --reward-rollouts 2 --max-new-tokens 16 --backend hf --bootstrap 50"
)
SMOKE_KEYS = (
    "settings",
    "stage1",
    "reward_before",
    "reward_after",
    "reward_delta",
    "eval_before",
    "eval_after",
    "grpo",
    "verdict",
)


def main() -> None:
    args = parse_args()
    with contextlib.redirect_stdout(sys.stderr):  # the trainer prints its logs; stdout is the JSON alone
        result = run(args)
    print(json.dumps(result))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m studies.grpo_signal", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", default="runs/grpo_signal")
    parser.add_argument("--stage1", help="an existing stage-1 model dir (default: train it into --out/sft)")
    parser.add_argument("--stage1-steps", type=int, default=SFT_PHASE["training"]["max_steps"])
    parser.add_argument("--train-images", type=int, default=SHAPES["n_train"])
    parser.add_argument(
        "--images", type=int, default=SHAPES["n_val"], help="val images the reward is measured on"
    )
    parser.add_argument("--steps", type=int, default=48, help="GRPO optimizer steps")
    parser.add_argument("--records-per-step", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=8, help="K: GRPO samples per record")
    parser.add_argument("--lr", type=float, default=ROLLOUT_PHASE["training"]["learning_rate"])
    parser.add_argument("--reward-rollouts", type=int, default=8, help="samples per image for the reward")
    parser.add_argument(
        "--reward-seed", type=int, default=1234, help="the reward samples' seed, before and after"
    )
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="sampling temperature of the GRPO rollouts and the reward samples (the dense study's arm: 0.7)",
    )
    parser.add_argument("--backend", choices=["hf", "vllm"], default=default_backend())
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out).absolute()
    started = time.perf_counter()
    settings = check_settings(out, args)
    shapes = {**SHAPES, "n_train": args.train_images, "n_val": args.images}
    build_inputs(out, shapes=shapes)
    overrides = [
        f"{_RM}.rollout_backend={args.backend}",
        f"{_RM}.max_new_tokens={args.max_new_tokens}",
    ]
    stage1, stage1_info = stage1_checkpoint(out, args, overrides)
    grpo_cfg = phase_config(out, grpo_phase(stage1, args), overrides)
    val = load_records(grpo_cfg.data.val_jsonl)[: args.images]

    def reward(model_dir: str) -> dict[str, Any]:
        return sampled_rewards(with_model(grpo_cfg, model_dir), val, args.reward_rollouts, args.reward_seed)

    def greedy(model_dir: str, name: str) -> dict[str, Any]:
        return eval_summary(run_eval(with_model(grpo_cfg, model_dir), val, str(out / f"eval_{name}.jsonl")))

    before = units.cached(out / "reward_before.json", lambda: reward(stage1))
    eval_before = units.cached(out / "eval_before.json", lambda: greedy(stage1, "before"))
    grpo = units.cached(out / "grpo.json", lambda: train_grpo(grpo_cfg))
    after = units.cached(out / "reward_after.json", lambda: reward(grpo["final_model_dir"]))
    eval_after = units.cached(out / "eval_after.json", lambda: greedy(grpo["final_model_dir"], "after"))
    delta = paired_mean_bootstrap(
        after["per_image"], before["per_image"], args.bootstrap, np.random.default_rng(0)
    )
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "commit": units.git_commit(),
        "command": "python -m studies.grpo_signal " + " ".join(args.argv),
        "machine": {"cpus": os.cpu_count(), "load_avg": list(os.getloadavg())},
        "settings": settings,
        "stage1": stage1_info,
        "reward_before": before,
        "reward_after": after,
        "reward_delta": delta,
        "eval_before": eval_before,
        "eval_after": eval_after,
        "grpo": grpo,
        "verdict": verdict(delta, eval_before, eval_after),
        "seconds_this_invocation": round(time.perf_counter() - started, 1),
    }
    (out / "grpo_signal.json").write_text(json.dumps(result, indent=1))
    return result


def check_settings(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings, kept in ``out/settings.json``; an ``out`` of other settings is refused."""
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "argv")}
    path = out / "settings.json"
    saved = json.loads(path.read_text()) if path.exists() else settings
    if saved != settings:
        changed = sorted(k for k in settings if saved.get(k) != settings[k])
        raise SystemExit(f"{out} holds a run with other settings ({changed}, {path}); use another --out")
    path.write_text(json.dumps(settings, indent=1))
    return settings


# --------------------------------------------------------------------------------------- stage-1
def stage1_checkpoint(
    out: Path, args: argparse.Namespace, overrides: list[str]
) -> tuple[str, dict[str, Any]]:
    """``--stage1`` as given, else the demo's stage-1 trained into ``out/sft`` (kept once trained)."""
    from rollmatch.training.entry import run_training

    if args.stage1:
        model = Path(args.stage1).absolute()
        if not (model / "config.json").exists():
            raise SystemExit(f"--stage1 {model}: no config.json there; point it at a trained model dir")
        return str(model), {"model": str(model), "trained_here": False}

    def train() -> dict[str, Any]:
        cfg = phase_config(out, SFT_PHASE, [*overrides, f"training.max_steps={args.stage1_steps}"])
        result = run_training(cfg)
        return {
            "model": result.final_model_dir,
            "steps": result.global_step,
            "seconds": round(result.seconds, 1),
        }

    info = units.cached(out / "stage1.json", train)
    return info["model"], {**info, "trained_here": True}


# ------------------------------------------------------------------------------------------ GRPO
def grpo_phase(stage1: str, args: argparse.Namespace) -> dict[str, Any]:
    """The demo's rollout phase with ``loss.objective: grpo``: K samples per record at ``--temperature``."""
    return deep_merge(
        ROLLOUT_PHASE,
        {
            "model": {"path": stage1},
            "loss": {"objective": "grpo"},
            "custom": {
                "extra": {
                    "rollout_matching": {
                        "rollouts_per_record": args.rollouts,
                        "decoding": {"temperature": args.temperature},
                    }
                }
            },
            "preflight": {"records": 0},  # a benchmark, not a run: no readiness check of the start model
            "training": {
                "output_dir": "{out}/grpo",
                "max_steps": args.steps,
                "learning_rate": args.lr,
                "per_device_train_batch_size": args.records_per_step,
                "logging_steps": 1,
            },
        },
    )


def train_grpo(cfg: RollmatchConfig) -> dict[str, Any]:
    from rollmatch.training.entry import run_training

    result = run_training(cfg)
    logged = [h for h in result.log_history if "grpo/reward_mean" in h]
    curve = [h["grpo/reward_mean"] for h in logged]
    first, last = curve_ends(curve, CURVE_ENDS)
    return {
        "final_model_dir": result.final_model_dir,
        "steps": result.global_step,
        "seconds": round(result.seconds, 1),
        "seconds_per_step": round(result.seconds / max(result.global_step, 1), 2),
        "reward_curve": [round(v, 4) for v in curve],
        "reward_steps": [h["step"] for h in logged],
        "reward_mean_first": first,
        "reward_mean_last": last,
        "zero_std_group_frac_mean": _mean([h.get("grpo/zero_std_group_frac") for h in logged]),
        "malformed_frac_mean": _mean([h.get("grpo/malformed_frac") for h in logged]),
    }


# ----------------------------------------------------------------------------------------- reward
def sampled_rewards(cfg: RollmatchConfig, records: Sequence[Record], k: int, seed: int) -> dict[str, Any]:
    """Each record's mean GRPO reward over ``k`` samples of ``cfg.model.path`` (``cfg``'s rollout decoding;
    request ``j`` of the call of records ``[start, ...)`` samples with ``seed + start * k + j``), and the
    share of records whose ``k`` rewards are all equal (``zero_std_group_frac``)."""
    from rollmatch.collectives import LocalCollectives
    from rollmatch.config.resolved import resolve_run_on_this_machine
    from rollmatch.data.prompts import PromptEncoder, load_processor
    from rollmatch.detection.object_formats import build_codec
    from rollmatch.models.pretrained import load_pretrained
    from rollmatch.rollout.alignment import check_prompt_alignment
    from rollmatch.rollout.build import build_backend
    from rollmatch.training.grpo_targets import GrpoGroups

    start_time = time.perf_counter()
    run = resolve_run_on_this_machine(cfg)
    encoder = PromptEncoder(
        load_processor(run.model_dir, *run.pixel_bounds), cfg.data.prompt, run.coord_frame
    )
    codec = build_codec(cfg.custom.object_format, encoder.tokenizer, [encoder.eos_token_id])
    backend = build_backend(
        run,
        model=load_pretrained(cfg),
        tokenizer=encoder.tokenizer,
        processor=encoder.processor,
        collectives=LocalCollectives(),
        eos_token_id=encoder.eos_token_id,
        pad_token_id=encoder.pad_token_id,
    )
    groups = GrpoGroups(encoder, codec, cfg)
    decoding = run.decoding
    per_image, malformed, truncated, zero_std = [], 0, 0, 0
    chunk = max(cfg.eval.batch_size // k, 1)
    try:
        for start in range(0, len(records), chunk):
            batch = records[start : start + chunk]
            encoded = [encoder.encode(r) for r in batch]
            requests = [e.to_request() for e in encoded for _ in range(k)]
            rollouts = backend.generate(requests, decoding, seed + start * k)
            for index, (record, enc) in enumerate(zip(batch, encoded, strict=True)):
                group = rollouts[index * k : (index + 1) * k]
                for rollout in group:
                    check_prompt_alignment(rollout, enc.input_ids, encoder.tokenizer)
                sums = [s for _, s, _ in groups.targets(record, enc, group)]
                rewards = [s["grpo/reward_sum"] for s in sums]
                per_image.append(float(np.mean(rewards)))
                zero_std += int(max(rewards) == min(rewards))  # no advantage in this group: no gradient
                malformed += sum(s["grpo/malformed"] for s in sums)
                truncated += sum(r.hit_max_tokens for r in group)
    finally:
        backend.close()
    samples = len(records) * k
    return {
        "mean": round(float(np.mean(per_image)), 4),
        "per_image": [round(v, 6) for v in per_image],
        "samples": samples,
        "temperature": decoding.temperature,
        "malformed_frac": round(malformed / samples, 4),
        "zero_std_group_frac": round(zero_std / len(records), 4),
        "truncated_frac": round(truncated / samples, 4),
        "seconds": round(time.perf_counter() - start_time, 1),
    }


def curve_ends(curve: Sequence[float], n: int) -> tuple[float | None, float | None]:
    """Mean of the first and of the last ``n`` values (at most half the curve each, so they never overlap)."""
    if not curve:
        return None, None
    size = max(1, min(n, len(curve) // 2))
    return round(float(np.mean(curve[:size])), 4), round(float(np.mean(curve[-size:])), 4)


def verdict(delta: dict[str, Any], before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The rule fixed before the run: reward interval above 0, and F1 at most ``F1_SLACK`` lower."""
    reward_rose = delta["ci95"][0] > 0
    f1_kept = after["f1"] >= before["f1"] - F1_SLACK
    return {
        "reward_rose": reward_rose,
        "f1_kept": f1_kept,
        "works": reward_rose and f1_kept,
        "f1_change": round(after["f1"] - before["f1"], 4),
        "map_change": round(after["map"] - before["map"], 4),
        "truncated_frac": [before["truncated_frac"], after["truncated_frac"]],
        "invalid": [before["invalid"], after["invalid"]],
    }


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(float(np.mean(present)), 4) if present else None


if __name__ == "__main__":
    main()
