"""Packing benchmark: row efficiency of the carry-buffer selection and packed-vs-padded training speed.

Prints ONE JSON object::

    {"distributions": {NAME: {"ours" | "fifo" | "binpacking": {"rows_over_lower_bound", "mean_fill", ...}}},
     "packed_over_padded_tokens_per_s": X, ...}

Segment lengths are measured with the tiny Qwen2.5-VL tokenizer and processor (prompt = chat template
+ image tokens + prompt text; response = the GT serialization + EOS, as Channel-A builds it):

- ``shapes``: synthetic 224 px shapes images with 1-6 objects (``data.shapes``);
- ``real``: the real datasets (aquarium YOLO labels, raccoon VOC xml), their true object counts,
  labels, boxes and image sizes, three shuffled epochs;
- ``lognormal``: heavy-tailed synthetic lengths.

Methods: ``ours`` streams the segments through :class:`CarryBuffer` (a batch of segments arrives
per step, one row leaves per step, then the buffer drains); ``fifo`` is next-fit in arrival order;
``binpacking`` is ``binpacking.to_constant_volume`` with every length known up front (offline).
``rows_over_lower_bound`` = rows / ceil(total tokens / capacity); ``mean_fill`` = tokens / (rows * capacity).

Speed: the same real samples trained (forward + backward) as packed rows vs right-padded batches of
the same number of samples per step (arrival order), and vs one sample per step; tokens/s counts
real (non-padding) tokens.

Run: ``.venv/bin/python bench/packing.py [--data DIR] [--seed N]`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import binpacking
import numpy as np
import torch

import rollmatch  # noqa: F401  (environment workarounds before transformers loads)
from rollmatch.config.schema import DataConfig, TrainingConfig
from rollmatch.data.convert import from_voc, from_yolo, read_yolo_names
from rollmatch.data.prompts import PromptEncoder
from rollmatch.data.records import Record
from rollmatch.data.shapes import shape_sample
from rollmatch.detection.codec import QwenJsonCodec
from rollmatch.detection.objects import DetObject, to_frame
from rollmatch.detection.targets import TargetSequence, build_gt_target
from rollmatch.models.tiny import build_tiny_model
from rollmatch.packing.binpack import fifo_greedy, plan_rows
from rollmatch.packing.carry import CarryBuffer
from rollmatch.packing.collate import enable_packed_attention, model_inputs, pack_row, pad_batch
from rollmatch.packing.segment import Segment, build_segment
from rollmatch.training.losses import weighted_ce_sum

DEFAULT_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
CAPACITY = TrainingConfig().global_max_length
CARRY_LIMIT = TrainingConfig().carry_buffer_size
SPEED_SAMPLES, SPEED_ROUNDS = 40, 2
BUFFERED_ARRIVALS = 1.05  # tokens arriving per step / row capacity for the `ours` stream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", type=Path, default=DEFAULT_DATA, help="folder with raccoon/ and aquarium_combined_v2/"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model("qwen2_5_vl", Path(tmp) / "model")
        encoder = PromptEncoder.from_pretrained(model_dir, DataConfig())
        records = real_records(args.data)
        lengths = {
            "shapes": shapes_lengths(encoder, Path(tmp), n=600, seed=args.seed),
            "real": [
                lengths
                for _ in range(3)
                for lengths in rng.permutation(real_lengths(encoder, records)).tolist()
            ],
            "lognormal": lognormal_lengths(rng, n=1500),
        }
        result: dict[str, Any] = {
            "capacity": CAPACITY,
            "carry_buffer_size": CARRY_LIMIT,
            "distributions": {name: compare_packers(values, CAPACITY) for name, values in lengths.items()},
        }
        result.update(training_speed(model_dir, encoder, records, rng))
    print(json.dumps(result, indent=1))


# ------------------------------------------------------------------------------------ segment lengths
def real_records(data: Path) -> list[Record]:
    aquarium = data / "aquarium_combined_v2"
    names = read_yolo_names(aquarium / "data.yaml")
    yolo = [r for split in ("valid", "test") for r in from_yolo(aquarium / split, names, dropped=[])]
    return yolo + from_voc(data / "raccoon", dropped=[])


def target_for(encoder: PromptEncoder, objects: Sequence[Any]) -> TargetSequence:
    codec = QwenJsonCodec(encoder.tokenizer, [encoder.eos_token_id])
    return build_gt_target(
        objects, codec=codec, tokenizer=encoder.tokenizer, eos_token_id=encoder.eos_token_id
    )


def real_lengths(encoder: PromptEncoder, records: Sequence[Record]) -> list[int]:
    """Prompt + GT target tokens per record; the prompt length depends only on the image size."""
    prompt_by_size: dict[tuple[int, int], Any] = {}
    lengths = []
    for record in records:
        if record.image_size not in prompt_by_size:
            prompt_by_size[record.image_size] = encoder.encode(record)
        encoded = prompt_by_size[record.image_size]
        target = target_for(encoder, encoder.gt_objects(record, encoded))
        lengths.append(len(encoded.input_ids) + len(target.token_ids))
    return lengths


def shapes_lengths(encoder: PromptEncoder, workdir: Path, n: int, seed: int) -> list[int]:
    """The demo's shapes set (224 px, 1-6 objects): one prompt length (same image size) + each target."""
    image, _ = shape_sample(0, seed=seed)
    image.save(workdir / "shape.png")
    first = Record(id="shape-0", images=(str(workdir / "shape.png"),), width=224, height=224)
    encoded = encoder.encode(first)
    lengths = []
    for index in range(n):
        _, objects = shape_sample(index, seed=seed)
        det = [
            DetObject(o.label, to_frame(o.bbox, (224, 224), encoder.coord_frame, encoded.frame_sizes[0]))
            for o in objects
        ]
        lengths.append(len(encoded.input_ids) + len(target_for(encoder, det).token_ids))
    return lengths


def lognormal_lengths(rng: np.random.Generator, n: int) -> list[int]:
    raw = rng.lognormal(mean=math.log(250), sigma=0.9, size=n)
    return [int(v) for v in np.clip(raw, 32, CAPACITY)]


# -------------------------------------------------------------------------------------- row packing
def compare_packers(lengths: Sequence[int], capacity: int) -> dict[str, Any]:
    lower_bound = math.ceil(sum(lengths) / capacity)
    mean_length = sum(lengths) / len(lengths)

    def summary(n_rows: int) -> dict[str, float]:
        return {
            "rows_over_lower_bound": round(n_rows / lower_bound, 4),
            "mean_fill": round(sum(lengths) / (n_rows * capacity), 4),
        }

    def streamed(arrival_ratio: float, limit: int) -> dict[str, Any]:
        rows, max_depth = stream_through_carry(
            lengths, capacity, arrival_ratio * capacity / mean_length, limit
        )
        return {**summary(rows), "arrivals_over_capacity": arrival_ratio, "max_carry_segments": max_depth}

    return {
        "segments": len(lengths),
        "mean_length": round(mean_length, 1),
        "max_length": max(lengths),
        "lower_bound_rows": lower_bound,
        # Arrivals slightly above one row per step keep a reserve in the buffer to select from.
        "ours": streamed(BUFFERED_ARRIVALS, limit=len(lengths)),
        # Arrivals of exactly one row per step under the default `training.carry_buffer_size`.
        "ours_at_row_rate": streamed(1.0, limit=CARRY_LIMIT),
        "ours_offline": summary(len(plan_rows(lengths, capacity))),
        "fifo": summary(len(fifo_greedy(lengths, capacity))),
        "binpacking": summary(len(binpacking.to_constant_volume(list(lengths), capacity))),
    }


def stream_through_carry(
    lengths: Sequence[int], capacity: int, per_step: float, limit: int
) -> tuple[int, int]:
    """Rows used when ``per_step`` segments (on average) arrive and one row leaves per step, then drain."""
    buffer = CarryBuffer(capacity_tokens=capacity, max_segments=limit)
    rows, max_depth, due, start = 0, 0, 0.0, 0
    while start < len(lengths):
        due += per_step  # whole segments arrive; the fraction carries to the next step
        stop = min(start + int(due), len(lengths))
        due -= int(due)
        rows += bool(buffer.next_row([length_only_segment(f"s{i}", lengths[i]) for i in range(start, stop)]))
        max_depth = max(max_depth, len(buffer))
        start = stop
    return rows + len(buffer.drain_rows()), max_depth


def length_only_segment(sample_id: str, length: int) -> Segment:
    ids = torch.zeros(length, dtype=torch.long)
    return Segment(sample_id, ids, torch.zeros(length), None, None, ids, ids.expand(3, -1))


# ------------------------------------------------------------------------------------ training speed
def training_speed(
    model_dir: Path, encoder: PromptEncoder, records: Sequence[Record], rng: np.random.Generator
) -> dict[str, Any]:
    """Tokens/s of forward + backward over the same samples: packed rows vs padded vs one per step."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.train()
    kernel_model = copy.deepcopy(model)
    enable_packed_attention(kernel_model)
    segments = [
        real_segment(model, encoder, records[i]) for i in rng.permutation(len(records))[:SPEED_SAMPLES]
    ]
    tokens = sum(s.length for s in segments)
    rows = plan_rows([s.length for s in segments], CAPACITY)
    packed = [pack_row([segments[i] for i in row]) for row in rows]
    per_step = max(1, round(len(segments) / len(rows)))
    padded = [
        pad_batch(segments[i : i + per_step], encoder.pad_token_id) for i in range(0, len(segments), per_step)
    ]
    runs: dict[str, tuple[Any, list[dict[str, Any]]]] = {
        "packed": (kernel_model, packed),
        "packed_masked_sdpa": (model, packed),
        "padded": (model, padded),
        "per_sample": (model, [pad_batch([s], encoder.pad_token_id) for s in segments]),
    }
    seconds = {name: math.inf for name in runs}
    torch.set_num_threads(1)  # measure work, not how a shared machine schedules threads
    for round_index in range(SPEED_ROUNDS + 1):  # interleaved rounds; round 0 warms up
        for name, (runner, batches) in runs.items():
            elapsed = train_seconds(runner, batches)
            if round_index:
                seconds[name] = min(seconds[name], elapsed)
    speed = {name: tokens / value for name, value in seconds.items()}
    return {
        "packed_over_padded_tokens_per_s": round(speed["packed"] / speed["padded"], 3),
        "speed": {
            "samples": len(segments),
            "tokens": tokens,
            "packed_rows": len(rows),
            "padded_batch_size": per_step,
            "padding_fraction": round(1 - tokens / sum(int(b["input_ids"].numel()) for b in padded), 4),
            "tokens_per_s_one_thread": {name: round(value, 1) for name, value in speed.items()},
            "packed_over_per_sample": round(speed["packed"] / speed["per_sample"], 3),
            "packed_masked_sdpa_over_padded": round(speed["packed_masked_sdpa"] / speed["padded"], 3),
        },
    }


def real_segment(model: Any, encoder: PromptEncoder, record: Record) -> Segment:
    encoded = encoder.encode(record)
    target = target_for(encoder, encoder.gt_objects(record, encoded))
    return build_segment(
        model,
        sample_id=record.id,
        prompt_ids=encoded.input_ids,
        response_ids=target.token_ids,
        response_weights=target.weights,
        pixel_values=encoded.pixel_values,
        image_grid_thw=encoded.image_grid_thw,
        prompt_mm_token_type_ids=encoded.mm_token_type_ids,
        max_length=CAPACITY,
    )


def train_seconds(model: Any, batches: Sequence[dict[str, Any]]) -> float:
    """CPU seconds of forward + backward over ``batches`` (gradients accumulate, then are dropped)."""
    start = time.process_time()
    for batch in batches:
        logits = model(**model_inputs(batch)).logits
        weighted_ce_sum(logits, batch["input_ids"], batch["weights"]).backward()
    model.zero_grad(set_to_none=True)
    return time.process_time() - start


if __name__ == "__main__":
    main()
