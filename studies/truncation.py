"""The truncation ratchet of rollout matching: former targets vs ``keep_prefix: all`` vs ``matched``.

Reproduces the former demo (tiny Qwen2.5-VL at its default rope theta, the shapes set as shipped
with 1-6 objects, 240 stage-1 steps, ``max_new_tokens`` 160), then:

1. rolls the stage-1 model out on 64 training images and reports, per image, what the targets
   built from those rollouts look like (elements, tokens, share longer than ``max_new_tokens``)
   for the former builder (whole prefix, the cut token ``"}`` kept and ``]`` after it) and for
   ``keep_prefix: matched``;
2. runs 30 rollout-matching steps (lr 3e-4, cosine) from the stage-1 model with each target
   builder, same seed, and evaluates val (truncated fraction, F1, objects per image, duplicate
   rate) after 15 and 30 steps.

The former builder is reproduced here as the baseline (``former_target``). Prints ONE JSON object
and writes it to ``--out/truncation.json``. About 10 minutes on 2 idle cores::

    .venv/bin/python -m studies.truncation --out runs/truncation
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import rollmatch  # noqa: F401  (environment workarounds before transformers loads)
from rollmatch.config.load import load_config_dict
from rollmatch.config.schema import LossConfig, RollmatchConfig
from rollmatch.data.records import load_records
from rollmatch.data.shapes import generate_shapes
from rollmatch.detection.codec import ObjectCodec, ParseResult, Tokenizer
from rollmatch.detection.json_scan import scan_json_list
from rollmatch.detection.matching import MatchResult, hungarian_match
from rollmatch.detection.objects import DetObject
from rollmatch.detection.targets import TargetSequence, _weighted_target, build_matched_target
from studies.units import cached, evaluate

MAX_NEW_TOKENS = 160
# Smallest setting (tests/studies/test_study_smoke.py runs it; docs/runbook.md "Benchmarks"): every phase on a
# couple of images and steps; its numbers only show that the script runs.
SMOKE_ARGS = (
    "--out {tmp}/truncation --stage1-steps 2 --train-size 4 --val-size 2 --stats-images 2 --rm-steps 2 "
    "--max-new-tokens 8"
)
SMOKE_KEYS = ("setup", "max_new_tokens", "targets_of_stage1_rollouts", "rollout_matching")
BUILDERS = ("former", "all", "matched")


def former_target(
    parse: ParseResult,
    gts: Sequence[DetObject],
    match: MatchResult,
    *,
    codec: ObjectCodec,
    tokenizer: Tokenizer,
    eos_token_id: int,
    loss: LossConfig,
) -> TargetSequence:
    """The former ``build_rollout_target``: the whole parsed prefix as the parser cut it (ending in
    ``"}``), then the encoded fragment of ``match.fn`` (``]`` alone when nothing was missed)."""
    fragment = codec.append_fragment([gts[g] for g in match.fn], after_element=parse.has_complete_element)
    return _weighted_target(
        prefix_ids=list(parse.prefix_token_ids),
        tail_ids=list(tokenizer.encode(fragment, add_special_tokens=False)),
        expected_text=parse.prefix_text + fragment,
        codec=codec,
        tokenizer=tokenizer,
        eos_token_id=eos_token_id,
        prefix_weight=loss.prefix_weight,
        desc_weight=loss.desc_weight,
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m studies.truncation", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/truncation")
    parser.add_argument("--rm-steps", type=int, default=30)
    parser.add_argument("--stage1-steps", type=int, default=240)
    parser.add_argument("--train-size", type=int, default=384)
    parser.add_argument("--val-size", type=int, default=48)
    parser.add_argument("--stats-images", type=int, default=64, help="training images rolled out in part 1")
    parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    args = parser.parse_args()
    with contextlib.redirect_stdout(sys.stderr):  # the trainer prints its logs; stdout is the JSON alone
        result = run(args)
    print(json.dumps(result))


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out).absolute()
    stage1 = former_demo_stage1(out, args)
    result: dict[str, Any] = {
        "setup": (
            f"former demo: qwen2_5_vl theta 1e6, shapes 1-6 objects ({args.train_size} train / "
            f"{args.val_size} val), {args.stage1_steps} sft steps"
        ),
        "max_new_tokens": args.max_new_tokens,
        "targets_of_stage1_rollouts": cached(
            out / "target_stats.json", lambda: target_stats(stage1, out, args)
        ),
        "rollout_matching": {
            b: cached(out / f"rm_{b}.json", lambda b=b: rollout_matching(stage1, out, b, args))
            for b in BUILDERS
        },
    }
    (out / "truncation.json").write_text(json.dumps(result, indent=2))
    return result


def base_config(out: Path, model: str, max_new_tokens: int, **training: Any) -> RollmatchConfig:
    return load_config_dict(
        {
            "model": {"path": model},
            "data": {
                "train_jsonl": str(out / "data" / "train.jsonl"),
                "val_jsonl": str(out / "data" / "val.jsonl"),
                "coord_frame": "norm1000",
            },
            "custom": {
                "extra": {"rollout_matching": {"rollout_backend": "hf", "max_new_tokens": max_new_tokens}}
            },
            "preflight": {"records": 0},  # a benchmark, not a run: no readiness check of the start model
            "training": {
                "per_device_train_batch_size": 8,
                "packing": True,
                "global_max_length": 4096,
                "report_to": [],
                "seed": 0,
                "save_total_limit": None,
                **training,
            },
            "eval": {"batch_size": 16},
        },
        [],
        source="studies/truncation.py",
    )


def former_demo_stage1(out: Path, args: argparse.Namespace) -> str:
    """The former demo's inputs and stage-1 phase (kept under ``out`` once built)."""
    from rollmatch.models.tiny import build_tiny_model
    from rollmatch.training.entry import run_training

    final = out / "sft" / "final"
    if (final / "config.json").exists():
        return str(final)
    build_tiny_model("qwen2_5_vl", out / "model", seed=0)
    generate_shapes(out / "data", n_train=args.train_size, n_val=args.val_size, size=224, seed=0)
    cfg = base_config(
        out,
        str(out / "model"),
        args.max_new_tokens,
        output_dir=str(out / "sft"),
        max_steps=args.stage1_steps,
        learning_rate=2e-3,
        lr_scheduler_type="cosine",
        warmup_ratio=0.05,
        save_steps=100000,
    )
    cfg = cfg.model_copy(update={"custom": cfg.custom.model_copy(update={"trainer_variant": "sft"})})
    run_training(cfg)
    return str(final)


def target_stats(model_dir: str, out: Path, args: argparse.Namespace) -> dict[str, float]:
    """Per image: GT, rollout and target sizes under the former builder and ``matched``."""
    import torch
    from transformers import AutoModelForImageTextToText

    from rollmatch.config.schema import DataConfig
    from rollmatch.data.prompts import PromptEncoder
    from rollmatch.detection.object_formats import build_codec
    from rollmatch.rollout.hf import HFBackend
    from rollmatch.rollout.types import Decoding

    encoder = PromptEncoder.from_pretrained(model_dir, DataConfig(coord_frame="norm1000"))
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    backend = HFBackend(
        model,
        encoder.tokenizer,
        eos_token_id=encoder.eos_token_id,
        pad_token_id=encoder.pad_token_id,
        batch_size=16,
    )
    records = load_records(out / "data" / "train.jsonl")[: args.stats_images]
    budget = args.max_new_tokens
    sums: Counter[str] = Counter()
    kwargs = {"codec": codec, "tokenizer": encoder.tokenizer, "eos_token_id": encoder.eos_token_id}
    for offset in range(0, len(records), 16):
        batch = records[offset : offset + 16]
        encoded = [encoder.encode(r) for r in batch]
        rollouts = backend.generate([e.to_request() for e in encoded], Decoding(max_new_tokens=budget), 0)
        for record, enc, rollout in zip(batch, encoded, rollouts, strict=True):
            gts = encoder.gt_objects(record, enc)
            parse = codec.parse(
                rollout.response_token_ids,
                extent=encoder.frame_extent(enc),
                hit_max_tokens=rollout.hit_max_tokens,
            )
            match = hungarian_match(parse.objects, gts)
            gt_tokens = len(encoder.tokenizer.encode(codec.serialize(gts), add_special_tokens=False)) + 1
            sums.update(
                images=1,
                gt_objects=len(gts),
                gt_tokens=gt_tokens,
                gt_over_budget=int(gt_tokens > budget),
                rollout_truncated=int(parse.truncated),
                rollout_elements=parse.num_complete,
                rollout_matched=len(match.pairs),
            )
            for name, builder in (("former", former_target), ("matched", build_matched_target)):
                target = builder(
                    parse, gts, match, loss=LossConfig(keep_prefix="matched", matched_prefix="none"), **kwargs
                )
                sums[f"{name}_target_elements"] += len(scan_json_list(target.text).elements)
                sums[f"{name}_target_tokens"] += len(target.token_ids)
                sums[f"{name}_target_over_budget"] += int(len(target.token_ids) > budget)
    images = sums.pop("images")
    return {"images": images, **{f"{k}_per_image": round(v / images, 3) for k, v in sums.items()}}


def rollout_matching(stage1: str, out: Path, builder: str, args: argparse.Namespace) -> dict[str, Any]:
    """``--rm-steps`` rollout-matching steps with one target builder; val metrics at half and full."""
    import shutil

    import rollmatch.training.segment_producers as channels
    from rollmatch.training.entry import run_training

    steps = args.rm_steps
    run_dir = out / f"rm_{builder}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    original = channels.build_matched_target
    channels.build_matched_target = former_target if builder == "former" else original
    try:
        cfg = base_config(
            out,
            stage1,
            args.max_new_tokens,
            output_dir=str(run_dir),
            max_steps=steps,
            learning_rate=3e-4,
            lr_scheduler_type="cosine",
            warmup_ratio=0.05,
            save_steps=steps // 2,
            logging_steps=5,
        )
        cfg = cfg.model_copy(
            update={
                "loss": LossConfig(
                    keep_prefix="all" if builder == "all" else "matched", matched_prefix="none"
                )
            }
        )
        result = run_training(cfg)
    finally:
        channels.build_matched_target = original
    val = load_records(out / "data" / "val.jsonl")
    evals = {
        "0": cached(out / "stage1_eval.json", lambda: evaluate(cfg, stage1, val, out / "stage1_preds.jsonl"))
    }
    for step in (steps // 2, steps):
        checkpoint = run_dir / f"checkpoint-{step}"
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "processor_config.json",
        ):
            shutil.copy(Path(stage1) / name, checkpoint / name)
        evals[str(step)] = evaluate(cfg, str(checkpoint), val, run_dir / f"preds-{step}.jsonl")
    train_log = [
        {
            k: round(v, 3)
            for k, v in h.items()
            if k.startswith(("rollout/truncated", "rollout/len", "target/", "step"))
        }
        for h in result.log_history
        if "loss" in h
    ]
    return {"val": evals, "train_log": train_log, "train_seconds": round(result.seconds, 1)}


if __name__ == "__main__":
    main()
