"""``rollmatch demo``: the whole pipeline on a tiny model, on CPU, in about ten minutes.

build (tiny Qwen2.5-VL with text rope theta 10 and coordinate tokens + an easy synthetic shapes
set, reused if present and built by the same recipe) -> eval before -> stage-1 ``sft`` -> eval -> ``rollout_matching_sft``
from the SFT model -> eval -> ``sft_control`` (more SFT from the same model, with the rollout
phase's steps and learning rate, so the table cannot credit rollout matching with what more
training or a lower learning rate did) -> eval -> summary table, ``summary.json``, ``summary.png`` and
``pictures.png`` (the first val images before / after each phase). Rollouts use the default
backend, vLLM colocated, when vLLM is installed (else HF generate). Its embedded default config is
:data:`DEMO_CONFIG` + :data:`SFT_PHASE` / :data:`ROLLOUT_PHASE`; any key can be overridden on the
command line (``rollmatch demo training.max_steps=5``).

The recipe (docs/runbook.md, "Demo"): rope theta 10 lets the tiny Qwen2.5-VL tell image-token
positions apart (docs/models.md); 1-2 shapes of 60-110 px per image are learnable in a few
minutes of CPU; a constant learning rate of 2e-3 after a short warm-up; boxes as coordinate tokens
(``coord_tokens``: one token per coordinate), which the learning-signal study found far ahead of
digits at equal steps (docs/detection.md, "What it reaches").
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from rollmatch.config.load import deep_merge, load_config_dict
from rollmatch.config.schema import DataConfig, MatchingConfig, RollmatchConfig
from rollmatch.data.records import Record, load_records
from rollmatch.data.shapes import ShapesDifficulty
from rollmatch.errors import DataError
from rollmatch.evaluation import EvalResult, run_eval
from rollmatch.models.tiny import TinySize

MODEL_FAMILY = "qwen2_5_vl"
MODEL_SIZE = TinySize(rope_theta=10.0)
OBJECT_FORMAT = "coord_tokens"
SHAPES: dict[str, Any] = {
    "n_train": 2000,
    "n_val": 64,
    "size": 224,
    "seed": 0,
    "difficulty": ShapesDifficulty(max_objects=2, min_side=60, max_side=110),
}
PICTURE_COUNT = 4  # val images per row of pictures.png

# Shared by both phases; phase-specific keys are in SFT_PHASE / ROLLOUT_PHASE.
DEMO_CONFIG: dict[str, Any] = {
    "model": {"path": "{out}/model", "dtype": "float32", "attn_implementation": "sdpa"},
    # norm1000 explicitly: the random tiny Qwen2.5-VL has no pretraining frame to keep (auto: pixels)
    "data": {
        "train_jsonl": "{out}/data/train.jsonl",
        "val_jsonl": "{out}/data/val.jsonl",
        "coord_frame": "norm1000",
    },
    "custom": {
        "object_format": OBJECT_FORMAT,
        "extra": {
            "rollout_matching": {
                "rollout_backend": "{backend}",
                "max_new_tokens": 160,
                "vllm": {"tensor_parallel_size": 1, "enforce_eager": True},
            }
        },
    },
    "training": {
        "per_device_train_batch_size": 8,
        "packing": True,
        # one packed row per micro-step must hold the micro-batch: 8 samples x ~250 tokens
        "global_max_length": 2048,
        "carry_buffer_size": 64,
        "logging_steps": 50,
        "save_steps": 100000,
        "report_to": ["tensorboard"],
        "lr_scheduler_type": "constant",
        "warmup_ratio": 0.02,
        "seed": 0,
        "num_train_epochs": 100,  # max_steps decides
    },
    "eval": {"batch_size": 16},
}
SFT_PHASE: dict[str, Any] = {
    "custom": {"trainer_variant": "sft"},
    "training": {"output_dir": "{out}/sft", "max_steps": 2400, "learning_rate": 2e-3},
}
ROLLOUT_PHASE: dict[str, Any] = {
    "model": {"path": "{out}/sft/final"},
    "custom": {"trainer_variant": "rollout_matching_sft"},
    # rollouts (up to max_new_tokens) + the missed-object tail: ~250 tokens x 8 per packed row
    "training": {
        "output_dir": "{out}/rollout",
        "max_steps": 40,
        "learning_rate": 3e-4,
        "logging_steps": 5,
        "log_rollouts_every": 10,  # the rollouts of steps 1, 10, 20, 30, 40 under {out}/rollout/rollouts
        "warmup_ratio": 0.0,
        "global_max_length": 4096,
    },
}
# The control of the rollout phase: the same steps, learning rate and model, teacher-forced on the GT.
SFT_CONTROL_PHASE: dict[str, Any] = deep_merge(
    ROLLOUT_PHASE, {"custom": {"trainer_variant": "sft"}, "training": {"output_dir": "{out}/sft_control"}}
)
PHASES = ("sft", "rollout_matching_sft", "sft_control")


def demo_command(args: argparse.Namespace) -> int:
    out = Path(args.out)
    summary = run_demo(out, args.overrides)
    print(format_table(summary))
    print(truncation_note(summary))
    print(control_note(summary))
    print(f"\nwrote {out / 'summary.json'}, {out / 'summary.png'} and {out / 'pictures.png'}")
    return 0


def run_demo(
    out: Path, overrides: list[str] | tuple[str, ...] = (), *, shapes: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The demo end to end under ``out``; ``shapes`` replaces :data:`SHAPES` (tests use a small set)."""
    from rollmatch.training.entry import run_training

    build_inputs(out, shapes=shapes or SHAPES)
    sft_cfg = phase_config(out, SFT_PHASE, overrides)
    rollout_cfg = phase_config(out, ROLLOUT_PHASE, overrides)
    control_cfg = phase_config(out, SFT_CONTROL_PHASE, overrides)
    val = load_records(sft_cfg.data.val_jsonl)

    start = time.perf_counter()
    phases: dict[str, Any] = {"before": eval_summary(run_eval(sft_cfg, val, str(out / "eval_before.jsonl")))}
    for name, cfg in (("sft", sft_cfg), ("rollout_matching_sft", rollout_cfg), ("sft_control", control_cfg)):
        result = run_training(cfg)
        evaluation = run_eval(with_model(cfg, result.final_model_dir), val, str(out / f"eval_{name}.jsonl"))
        logged = [h for h in result.log_history if "loss" in h]
        losses = [h["loss"] for h in logged]
        phases[name] = {
            "steps": result.global_step,
            "seconds": round(result.seconds, 1),
            "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None,
            "losses": losses,
            "loss_steps": [h["step"] for h in logged],
            "f1_curve": [h["match/f1"] for h in result.log_history if "match/f1" in h],
            **eval_summary(evaluation),
        }
    summary = {
        "seconds_total": round(time.perf_counter() - start, 1),
        "object_format": sft_cfg.custom.object_format,
        "phases": phases,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_summary(summary, out / "summary.png")
    plot_pictures(val, out, out / "pictures.png", matching=sft_cfg.eval.matching)
    return summary


def image_use(model_dir: str | Path, records: Sequence[Record], data_cfg: DataConfig) -> dict[str, float]:
    """Does the model look at the image to place boxes? Mean loss per GT coordinate token, teacher
    forced, with each record's own image (``own``) and with the next record's image (``shuffled``).

    A model that ignores the image scores the same on both; one that uses it is clearly lower on
    ``own``. Records must share one image size (the boxes stay those of the record).
    """
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForImageTextToText

    from rollmatch.data.prompts import PromptEncoder
    from rollmatch.detection.codec import decode_with_offsets
    from rollmatch.detection.json_scan import VALUE
    from rollmatch.detection.object_formats import build_codec
    from rollmatch.detection.targets import build_gt_target

    sizes = {r.image_size for r in records}
    if len(records) < 2 or len(sizes) != 1:
        raise DataError(
            f"image_use needs >= 2 records of one image size; got {len(records)} with sizes {sizes}"
        )
    encoder = PromptEncoder.from_pretrained(model_dir, data_cfg)
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    result: dict[str, float] = {}
    for name, shift in (("own", 0), ("shuffled", 1)):
        total, count = 0.0, 0
        for index, record in enumerate(records):
            donor = records[(index + shift) % len(records)]
            encoded = encoder.encode(replace(record, images=donor.images))
            target = build_gt_target(
                encoder.gt_objects(record, encoded),
                codec=codec,
                tokenizer=encoder.tokenizer,
                eos_token_id=encoder.eos_token_id,
            )
            ids = target.token_ids[:-1]
            text = decode_with_offsets(encoder.tokenizer, ids)
            roles = codec.char_roles(text.text)
            coordinate = [VALUE in roles[start:stop] for start, stop in text.token_spans()]
            inputs = encoded.model_inputs()
            n_prompt = inputs["input_ids"].shape[1]
            inputs["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([ids])], dim=1)
            inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
            inputs["mm_token_type_ids"] = torch.cat(
                [inputs["mm_token_type_ids"], torch.zeros(1, len(ids), dtype=torch.long)], dim=1
            )
            with torch.no_grad():
                logits = model(**inputs).logits[0, n_prompt - 1 : -1].float()
            losses = F.cross_entropy(logits, torch.tensor(ids), reduction="none")
            mask = torch.tensor(coordinate)
            total += float(losses[mask].sum())
            count += int(mask.sum())
        result[name] = total / count
    return result


def build_inputs(out: Path, *, with_data: bool = True, shapes: dict[str, Any] = SHAPES) -> None:
    """The demo's tiny model and shapes set under ``out`` (kept when built by the same recipe).

    ``out/inputs.json`` records the recipe; inputs from another recipe (an older demo) are rebuilt.
    """
    from rollmatch.data.shapes import generate_shapes
    from rollmatch.models.tiny import build_tiny_model

    out.mkdir(parents=True, exist_ok=True)
    recipe_path = out / "inputs.json"
    recipe = {
        "model": {
            "family": MODEL_FAMILY,
            **asdict(MODEL_SIZE),
            "coord_tokens": OBJECT_FORMAT == "coord_tokens",
        },
        "shapes": {**shapes, "difficulty": asdict(shapes["difficulty"])},
    }
    previous = json.loads(recipe_path.read_text()) if recipe_path.exists() else {}
    if previous.get("model") != recipe["model"] or not (out / "model" / "config.json").exists():
        build_tiny_model(
            MODEL_FAMILY,
            out / "model",
            seed=0,
            size=MODEL_SIZE,
            coord_tokens=recipe["model"]["coord_tokens"],
        )
    if with_data and (
        previous.get("shapes") != recipe["shapes"] or not (out / "data" / "val.jsonl").exists()
    ):
        generate_shapes(out / "data", **shapes)
    recipe_path.write_text(json.dumps(recipe, indent=1))


def phase_config(out: Path, phase: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> RollmatchConfig:
    text = json.dumps(deep_merge(DEMO_CONFIG, phase)).replace("{out}", str(out))
    merged = json.loads(text.replace("{backend}", default_backend()))
    return load_config_dict(merged, overrides, source="rollmatch demo")


def default_backend() -> str:
    """vLLM (colocated) when it is installed, else HF generate."""
    import importlib.util

    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


def with_model(cfg: RollmatchConfig, model_dir: str) -> RollmatchConfig:
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": model_dir})})


def eval_summary(result: EvalResult) -> dict[str, Any]:
    data = asdict(result)
    data["eval_seconds"] = data.pop("seconds")
    return {
        k: (round(v, 4) if isinstance(v, float) else v) for k, v in data.items() if k != "predictions_path"
    }


def format_table(summary: dict[str, Any]) -> str:
    header = (
        f"{'phase':<22}{'steps':>7}{'seconds':>9}{'loss':>9}{'P@.5':>8}{'R@.5':>8}{'F1@.5':>8}{'mAP':>8}"
        f"{'trunc':>8}"
    )
    lines = [header, "-" * len(header)]
    for name, p in summary["phases"].items():
        loss = f"{p['loss_last']:.3f}" if p.get("loss_last") is not None else "-"
        lines.append(
            f"{name:<22}{p.get('steps', 0):>7}{p.get('seconds', 0):>9}{loss:>9}"
            f"{p['precision']:>8.3f}{p['recall']:>8.3f}{p['f1']:>8.3f}{p['map']:>8.3f}{p['truncated_frac']:>8.3f}"
        )
    before = summary["phases"]["before"]
    lines.append(
        f"boxes as {summary['object_format']}; scored with eval.matching: label_mode {before['label_mode']}, "
        f"IoU >= {before['iou_threshold']}"
    )
    return "\n".join(lines)


def truncation_note(summary: dict[str, Any]) -> str:
    """One line on whether rollout matching made answers run to ``max_new_tokens`` more often than
    stage-1 did, and than its SFT control at equal steps (a rise both share is not rollout matching's)."""
    before = summary["phases"]["sft"]["truncated_frac"]
    after = summary["phases"]["rollout_matching_sft"]["truncated_frac"]
    control = summary["phases"].get("sft_control", {}).get("truncated_frac")
    if after <= before:
        return (
            f"truncated fraction after rollout matching: {after:.3f} (after stage-1: {before:.3f}; no rise)"
        )
    if control is not None and after <= control:
        return (
            f"truncated fraction after rollout matching: {after:.3f} (after stage-1: {before:.3f}); as high "
            f"after more SFT at equal steps ({control:.3f}): the rise is not rollout matching's"
        )
    return (
        f"truncated fraction ROSE after rollout matching: {before:.3f} -> {after:.3f}; see the answers in "
        "eval_rollout_matching_sft.jsonl and docs/detection.md (targets of truncated rollouts)"
    )


def control_note(summary: dict[str, Any]) -> str:
    """One line: rollout matching against more SFT at equal steps (the demo's only fair comparison)."""
    rollout, control = (summary["phases"][name]["f1"] for name in ("rollout_matching_sft", "sft_control"))
    return (
        f"rollout matching vs more SFT at equal steps: F1 {rollout:.3f} vs {control:.3f} "
        f"({rollout - control:+.3f}; one run of 64 val images, no interval: docs/runbook.md, 'Does it learn?')"
    )


def plot_summary(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_f1) = plt.subplots(1, 2, figsize=(11, 4))
    stage1_steps = summary["phases"]["sft"]["steps"]
    for name in PHASES:  # the rollout phase and its control both start where stage-1 ended
        phase = summary["phases"][name]
        offset = 0 if name == "sft" else stage1_steps
        ax_loss.plot([offset + s for s in phase["loss_steps"]], phase["losses"], label=name)
    ax_loss.set(title="training loss", xlabel="optimizer step (from stage-1's start)", ylabel="loss")
    ax_loss.legend()
    names = list(summary["phases"])
    colours = ["grey", "tab:blue", "tab:orange", "tab:green"]
    ax_f1.bar(names, [summary["phases"][n]["f1"] for n in names], color=colours[: len(names)])
    ax_f1.set(title="val F1 @ IoU 0.5 (labels required)", ylim=(0, 1))
    ax_f1.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_pictures(val: list[Any], out: Path, path: Path, *, matching: MatchingConfig) -> None:
    """The first val images with their boxes before training and after each phase, one row each."""
    from rollmatch.data.records import load_image
    from rollmatch.viz import compose_grid, draw_detections, read_predictions

    rows = []
    for name, title in (
        ("before", "before"),
        ("sft", "stage-1 sft"),
        ("rollout_matching_sft", "rollout match."),
        ("sft_control", "sft control"),
    ):
        predicted = read_predictions(out / f"eval_{name}.jsonl")
        pictures = [
            draw_detections(
                load_image(r.images[0]), r.objects, predicted[r.id], record_id=r.id, matching=matching
            )
            for r in val[:PICTURE_COUNT]
        ]
        rows.append((title, pictures))
    compose_grid(rows, title="rollmatch demo: val images").save(path)
