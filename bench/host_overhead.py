"""Host overhead of rollout-matching: parse + match + target building vs HF rollout generation.

For each dataset, every sample gets a rollout-like response with as many objects as its GT (the
GT serialization with each box jittered by a few units and every third object dropped, so the
parse, the matching and the FN tail all do real work). Host seconds per sample = strict parse +
Hungarian match + Y_train construction; rollout seconds per sample = HF generate on the tiny
model producing exactly as many tokens as that response, for the same batch. Prints one JSON
object: {"datasets": {NAME: {"host_seconds_per_sample", "rollout_seconds_per_sample", "ratio"}}}.
The host side is the trainer's own path: ``detection.scoring.score_response`` (strict parse +
matching with the default ``matching.*``) and ``build_rollout_target``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

import rollmatch  # noqa: F401  (environment workarounds)
from rollmatch.config.schema import DataConfig, MatchingConfig
from rollmatch.data.convert import from_yolo, read_yolo_names
from rollmatch.data.prompts import PromptEncoder
from rollmatch.data.records import load_records
from rollmatch.data.shapes import generate_shapes
from rollmatch.detection.object_formats import build_codec
from rollmatch.detection.objects import DetObject
from rollmatch.detection.scoring import score_response
from rollmatch.detection.targets import build_rollout_target
from rollmatch.models.tiny import build_tiny_model
from rollmatch.rollout.hf import left_padded_inputs

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
BATCH = 4
SAMPLES = 16
# Smallest setting (tests/test_benches.py runs it; docs/runbook.md "Benchmarks").
SMOKE_ARGS = "--samples 1 --batch 1"  # the densest aquarium image: ~1,000 generated tokens
SMOKE_KEYS = ("datasets",)


def jittered_response(gts: list[DetObject], rng: random.Random, extent: tuple[int, int]) -> list[DetObject]:
    out = []
    for i, o in enumerate(gts):
        if i % 3 == 2:
            continue
        x1, y1, x2, y2 = (v + rng.randint(-3, 3) for v in o.bbox)
        x1, y1 = max(0, x1), max(0, y1)
        x2, y2 = min(extent[0], max(x2, x1 + 1)), min(extent[1], max(y2, y1 + 1))
        out.append(DetObject(o.label, (x1, y1, x2, y2)))
    return out


def measure(
    records: list, model: torch.nn.Module, encoder: PromptEncoder, batch_size: int
) -> dict[str, float]:
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    matching = MatchingConfig()
    tok = encoder.tokenizer
    rng = random.Random(0)
    host = rollout = 0.0
    for start in range(0, len(records), batch_size):
        batch = records[start : start + batch_size]
        encoded = [encoder.encode(r) for r in batch]
        responses = []
        for record, enc in zip(batch, encoded, strict=True):
            gts = encoder.gt_objects(record, enc)
            pred = jittered_response(gts, rng, encoder.frame_extent(enc))
            responses.append((gts, tok.encode(codec.serialize(pred), add_special_tokens=False)))
        t0 = time.perf_counter()
        for enc, (gts, ids) in zip(encoded, responses, strict=True):
            extent = encoder.frame_extent(enc)
            scored = score_response(codec, ids, gts, extent=extent, hit_max_tokens=False, matching=matching)
            build_rollout_target(
                scored.parse,
                scored.missed,
                codec=codec,
                tokenizer=tok,
                eos_token_id=encoder.eos_token_id,
            )
        host += time.perf_counter() - t0
        n_new = max(len(ids) for _, ids in responses)
        inputs = left_padded_inputs(
            [e.to_request() for e in encoded], encoder.pad_token_id, torch.device("cpu")
        )
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(
                **inputs,
                do_sample=False,
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                pad_token_id=encoder.pad_token_id,
            )
        rollout += time.perf_counter() - t0
    n = len(records)
    return {
        "samples": n,
        "mean_objects": sum(len(r.objects) for r in records) / n,
        "host_seconds_per_sample": host / n,
        "rollout_seconds_per_sample": rollout / n,
        "ratio": host / rollout,
    }


def main() -> None:
    from transformers import AutoModelForImageTextToText

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=SAMPLES, help="images per dataset")
    parser.add_argument("--batch", type=int, default=BATCH, help="rollouts per generate call")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model("qwen2_5_vl", Path(tmp) / "model", seed=0)
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        encoder = PromptEncoder.from_pretrained(model_dir, DataConfig(coord_frame="norm1000"))
        shapes = load_records(
            generate_shapes(Path(tmp) / "shapes", n_train=args.samples, n_val=1, size=224)["train"]
        )
        datasets = {"shapes": shapes}
        aquarium = SHARED / "aquarium_combined_v2"
        if aquarium.is_dir():
            recs = from_yolo(aquarium / "valid", names=read_yolo_names(aquarium / "data.yaml"))
            # the densest images: the aquarium counts go up to 45 objects per image
            datasets["aquarium"] = sorted(recs, key=lambda r: -len(r.objects))[: args.samples]
        else:
            print(f"warning: {aquarium} not found; aquarium skipped", file=sys.stderr)
        result = {
            "datasets": {name: measure(recs, model, encoder, args.batch) for name, recs in datasets.items()}
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
