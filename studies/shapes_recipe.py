"""The recipe the shapes studies share: their data, their base training config, and the reading of
rollout targets against SFT's.

Owns: :func:`generate_splits` (each split from its own seed of the shapes generator) and
:func:`data_summary`, :func:`base_config` (the tiny model's training settings every arm and stage-1
start from; a driver sets the variant, loss and schedule), and :func:`target_reading` (how often a
target built from stage-1's own answer differs from SFT's, and keeps the answer's own elements).

Leaves out: each study's arms and protocol (its driver, ``studies/study_protocols.py``), running units
(``studies/units.py``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from rollmatch.config.schema import LossConfig, RollmatchConfig
from rollmatch.data.records import Record, load_records
from rollmatch.data.shapes import ShapesDifficulty, generate_shapes


def generate_splits(out: Path, sizes: dict[str, int], difficulty: ShapesDifficulty) -> dict[str, Path]:
    """Each split of ``sizes`` (in order) from its own generator seed 0, 1, 2, ... under ``out/data``;
    a split already generated is kept."""
    paths = {}
    for seed, (split, size) in enumerate(sizes.items()):
        folder = out / "data" / split
        if not (folder / "done").exists():
            # the dev/report images are the generator's val split of their own seed
            generate_shapes(
                folder,
                n_train=size if split == "train" else 1,
                n_val=0 if split == "train" else size,
                seed=seed,
                difficulty=difficulty,
            )
            (folder / "done").write_text("")
        paths[split] = folder / ("train.jsonl" if split == "train" else "val.jsonl")
    return paths


def data_summary(splits: dict[str, Path]) -> dict[str, Any]:
    summary = {}
    for split, path in splits.items():
        records = load_records(path)
        counts = [len(r.objects) for r in records]
        repeats = [len({o.label for o in r.objects}) < len(r.objects) for r in records]
        tied = [
            any(abs(a.bbox[1] - b.bbox[1]) <= 3 for a, b in zip(r.objects, r.objects[1:], strict=False))
            for r in records
        ]
        summary[split] = {
            "images": len(records),
            "objects_per_image": round(float(np.mean(counts)), 2),
            "images_repeating_a_label": round(float(np.mean(repeats)), 3),
            "images_with_a_near_tied_row": round(float(np.mean(tied)), 3),
        }
    return summary


def base_config(
    output_dir: Path, model: str, splits: dict[str, Path], args: argparse.Namespace, *, seed: int
) -> dict[str, Any]:
    return {
        "model": {"path": model, "dtype": "float32", "attn_implementation": "sdpa"},
        "data": {"train_jsonl": str(splits["train"]), "val_jsonl": None, "coord_frame": "norm1000"},
        "custom": {
            "trainer_variant": "sft",
            "object_format": args.object_format,
            "extra": {
                "rollout_matching": {
                    "rollout_backend": args.backend,
                    "max_new_tokens": args.max_new_tokens,
                    "vllm": {"tensor_parallel_size": 1, "enforce_eager": True},
                }
            },
        },
        "training": {
            "output_dir": str(output_dir),
            "per_device_train_batch_size": 8,
            "packing": True,
            "global_max_length": 4096,
            "lr_scheduler_type": "constant",
            "save_total_limit": None,
            "logging_steps": 25,
            "report_to": [],
            "seed": seed,
            "num_train_epochs": 100,
        },
        "eval": {"batch_size": 50},
    }


def target_reading(
    cfg: RollmatchConfig,
    stage1: Path,
    dev: list[Record],
    predictions: Path,
    losses: dict[str, LossConfig],
) -> dict[str, dict[str, float]]:
    """Per target of ``losses`` (a name and its loss settings): ``differs``, the share of dev rollouts whose target
    holds other token ids than SFT's, and ``keeps_own``, the share whose target keeps at least one of
    the rollout's elements (rewritten to its GT or not). A kept prefix rewritten to its GT is SFT's own
    start whenever it lists SFT's first objects in SFT's order, so ``keeps_own`` far above ``differs``
    says the model keeps the canonical order and the target adds nothing to SFT there."""
    from rollmatch.data.prompts import PromptEncoder
    from rollmatch.detection.object_formats import build_codec
    from rollmatch.detection.scoring import score_response
    from rollmatch.detection.targets import build_matched_target, target_differs_from_sft

    encoder = PromptEncoder.from_pretrained(stage1, cfg.data, object_format=cfg.custom.object_format)
    codec = build_codec(cfg.custom.object_format, encoder.tokenizer, [encoder.eos_token_id])
    answers = [json.loads(line) for line in predictions.read_text().splitlines()]
    differ, keep = dict.fromkeys(losses, 0), dict.fromkeys(losses, 0)
    for record, answer in zip(dev, answers, strict=True):
        encoded = encoder.encode(record)
        ids = encoder.tokenizer.encode(answer["text"], add_special_tokens=False)  # special tokens kept
        scored = score_response(
            codec,
            ids,
            encoder.gt_objects(record, encoded),
            extent=encoder.frame_extent(encoded),
            hit_max_tokens=answer["truncated"],
            matching=cfg.eval.matching,
        )
        common = {"codec": codec, "tokenizer": encoder.tokenizer, "eos_token_id": encoder.eos_token_id}
        for name, loss in losses.items():
            target = build_matched_target(scored.parse, scored.gt_objects, scored.match, loss=loss, **common)
            differ[name] += int(target_differs_from_sft(target, scored.gt_objects, codec, encoder.tokenizer))
            keep[name] += int(scored.parse.num_complete > target.dropped_elements)
    return {
        name: {"differs": round(differ[name] / len(dev), 3), "keeps_own": round(keep[name] / len(dev), 3)}
        for name in losses
    }
