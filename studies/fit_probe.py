"""Can a stage-1 model fit the images it trains on, and at which image size?

A dense study whose stage-1 plateaus below its gate (docs/runbook.md, "Crowded scenes") scores little
better on its training images than on dev. This probe separates what the model can write from what
it learns: it continues the study's gated stage-1 checkpoint on the first ``--images`` training
images for ``--steps`` steps at each ``--pixels`` (the image resized to that many pixels: for the
tiny Qwen3-VL 224 x 224 is 7 x 7 visual tokens of 32 px, 448 x 448 is 14 x 14 of 16 px), the same
recipe otherwise, and evaluates each on those training images and on as many dev images at the same
size (greedy, the study's matching). Reading it: a model that cannot fit a few dozen images is
limited by what it can write or see at that size; one that fits them while dev falls has memorised
them (telling 64 images apart is enough for that), so its plateau on thousands of images is one of
learning a localiser that transfers, and the probe alone does not say whether more pixels or a
larger model would learn one; the sizes' dev F1 and seconds per step are what a next study budgets.

Every unit (the checkpoint before training, each size's run and evaluations) writes its own JSON under
``--out`` (default ``<study>/fit_probe``) and a rerun skips what is done. Prints ONE JSON object (also
``--out/fit_probe.json``): per size the training and dev F1, recall per GT-count bucket and seconds per
step, and each size's training F1 over the first size's (``train_f1_ratio``). Run::

    .venv/bin/python -m studies.fit_probe --study runs/crowd          # ~12 min of 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import rollmatch  # noqa: F401  (environment workarounds before transformers loads)
from rollmatch.config.load import load_config_dict
from rollmatch.config.schema import RollmatchConfig
from rollmatch.data.prompts import image_probe, load_processor
from rollmatch.data.records import load_records, write_records
from studies import dense_arms, dense_summary, shapes_recipe, units

LOCKED = ("images", "steps", "lr", "max_new_tokens")  # a probe folder's settings; sizes may be added
# Smallest setting (tests/studies/test_study_smoke.py runs it after dense_study's, on that study folder).
SMOKE_ARGS = (
    "--study {tmp}/dense_study --images 2 --steps 2 --pixels 50176 200704 --max-new-tokens 16 --backend hf"
)
SMOKE_KEYS = ("study", "checkpoint", "images", "steps", "before", "sizes", "train_f1_ratio")
SMOKE_AFTER = ("dense_study",)


def main() -> None:
    args = parse_args()
    with contextlib.redirect_stdout(sys.stderr):  # the trainer prints its logs; stdout is the JSON alone
        result = run_probe(args)
    print(json.dumps(result, indent=1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m studies.fit_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--study", required=True, help="a studies/dense_study.py --out with a stage-1 gate")
    parser.add_argument("--out", help="this probe's folder (default: <study>/fit_probe)")
    parser.add_argument("--images", type=int, default=64, help="training images (and dev images) used")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps per size (8 images each)")
    parser.add_argument("--lr", type=float, default=2e-3, help="constant after a 5%% warm-up (stage-1's)")
    parser.add_argument(
        "--pixels",
        type=int,
        nargs="+",
        default=[224 * 224, 448 * 448],
        help="image sizes (224 x 224: the study's)",
    )
    parser.add_argument("--max-new-tokens", type=int, help="default: the study's")
    parser.add_argument(
        "--backend", choices=["hf", "vllm"], default=units.default_backend(), help="evaluation"
    )
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.images < 1 or args.steps < 1 or min(args.pixels) < 28 * 28:
        parser.error("--images and --steps must be >= 1, every --pixels >= 784")
    return args


def run_probe(args: argparse.Namespace) -> dict[str, Any]:
    study = Path(args.study).absolute()
    out = Path(args.out).absolute() if args.out else study / "fit_probe"
    settings = json.loads((study / "settings.json").read_text())
    checkpoint = gated_checkpoint(study)
    args.max_new_tokens = args.max_new_tokens or settings["max_new_tokens"]
    units.lock_settings(out, args, LOCKED, "probe")
    splits = subsets(dense_arms.prepare_data(study, argparse.Namespace(**settings)), out, args.images)
    recipe = argparse.Namespace(
        object_format=settings["object_format"], max_new_tokens=args.max_new_tokens, backend=args.backend
    )
    image_size = load_records(splits["train"], max_samples=1)[0].image_size  # one size per preset
    study_pixels = image_size[0] * image_size[1]  # what the study's stage-1 saw
    before_cfg = probe_config(out / "before", checkpoint, splits, recipe, args, study_pixels, steps=1)
    before = evaluations(before_cfg, checkpoint, checkpoint, splits, out / "before")
    sizes = {}
    for pixels in args.pixels:
        folder = out / f"px{pixels}"
        cfg = probe_config(folder, checkpoint, splits, recipe, args, pixels, steps=args.steps)
        seconds, _ = units.train_with_cost(cfg, folder, args.steps)
        sizes[str(pixels)] = {
            "visual_tokens_per_side": visual_tokens_per_side(checkpoint, pixels, image_size),
            "seconds_per_step": round(seconds / args.steps, 3),
            **evaluations(cfg, folder / "final", checkpoint, splits, folder),
        }
    first_f1 = sizes[str(args.pixels[0])]["train"]["f1"]
    result = {
        "study": str(study),
        "checkpoint": str(checkpoint),
        "images": args.images,
        "steps": args.steps,
        "lr": args.lr,
        "before": {"pixels": study_pixels, **before},
        "sizes": sizes,
        "train_f1_ratio": {
            px: round(s["train"]["f1"] / first_f1, 3) if first_f1 else None for px, s in sizes.items()
        },
        "command": "python -m studies.fit_probe " + " ".join(args.argv),
        "commit": dense_arms.code_commit(),
    }
    (out / "fit_probe.json").write_text(json.dumps(result, indent=1))
    return result


def gated_checkpoint(study: Path) -> Path:
    """The checkpoint the study's gate judged last (``gate.json`` once it decided, else the newest
    ``stage1/gate-<steps>.json``)."""
    gates = dense_summary.chunk_gates(study)
    path = study / "gate.json" if (study / "gate.json").exists() else (gates[-1] if gates else None)
    if path is None:
        raise SystemExit(
            f"{study} has no stage-1 gate yet: run python -m studies.dense_study --out {study} --only-gate"
        )
    return Path(json.loads(path.read_text())["checkpoint"])


def visual_tokens_per_side(checkpoint: Path, pixels: int, image_size: tuple[int, int]) -> float:
    """The square root of the image tokens the checkpoint's processor makes of an ``image_size`` image
    resized to ``pixels`` (the tiny Qwen3-VL: 7 at 224 x 224, 14 at 448 x 448)."""
    _, tokens = image_probe(load_processor(checkpoint, pixels, pixels), image_size)
    return round(tokens**0.5, 1)


def subsets(study_splits: dict[str, Path], out: Path, images: int) -> dict[str, Path]:
    """The first ``images`` records of the study's train and dev splits (absolute image paths)."""
    found = {}
    for split in ("train", "dev"):
        records = load_records(study_splits[split], max_samples=images)
        found[split] = out / "data" / f"{split}-{images}.jsonl"
        if not found[split].exists():
            write_records(found[split], records)
    return found


def probe_config(
    folder: Path,
    checkpoint: Path,
    splits: dict[str, Path],
    recipe: argparse.Namespace,
    args: argparse.Namespace,
    pixels: int,
    *,
    steps: int,
) -> RollmatchConfig:
    config = shapes_recipe.base_config(folder, str(checkpoint), splits, recipe, seed=0)
    config["data"].update(min_pixels=pixels, max_pixels=pixels)
    config["training"].update(
        max_steps=steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_ratio=0.05,
        save_steps=max(steps // 4, 1),
    )
    if any(folder.glob("checkpoint-*/rollmatch_complete.json")):
        config["training"]["resume_from_checkpoint"] = "latest"
    return load_config_dict(config, [], source="studies/fit_probe.py")


def evaluations(
    cfg: RollmatchConfig, model: Path, stage1: Path, splits: dict[str, Path], folder: Path
) -> dict[str, Any]:
    """F1, precision, recall and recall per GT-count bucket on the training and dev subsets."""
    found = {}
    for split in ("train", "dev"):
        result = dense_arms.evaluation(cfg, model, stage1, splits, split, folder, 0)
        found[split] = {
            "f1": round(result["f1"], 4),
            "precision": round(result["precision"], 4),
            "recall": round(result["recall"], 4),
            "recall_by_bucket": {
                bucket: round(values["recall"], 3) for bucket, values in result["gt_count_buckets"].items()
            },
            "count_mae": round(result["count_mae"], 2),
            "matched_iou": round(result["mean_iou"], 3),
        }
    return found


if __name__ == "__main__":
    main()
