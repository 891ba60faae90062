"""Packing benchmark: rows used by our selection vs baselines, and packed-vs-padded training speed.

Prints ONE JSON object::

    {"distributions": {MIX: {"offline": {"ours" | "fifo" | "binpacking": {"rows", "rows_over_lower_bound", ...}},
                             "streamed": {"one_row_per_step_bound", "ours", "ours_as_trainer", "fifo", "binpacking": {...}},
                             "streamed_at_row_rate": {...}, "checks": {...}}},
     "selection_cost": {"select_over_train_row", ...}, "packed_over_padded_tokens_per_s": X, ...}

Segment lengths are measured with the tiny Qwen2.5-VL tokenizer and processor (prompt = chat template
+ image tokens + prompt text; response = the GT serialization + EOS, as Channel-A builds it):

- ``shapes``: synthetic 224 px shapes images with 1-6 objects (``data.shapes``);
- ``real``: the real datasets (aquarium YOLO labels, raccoon VOC xml), their true object counts,
  labels, boxes and image sizes, three shuffled epochs;
- ``lognormal``: heavy-tailed synthetic lengths;
- ``bimodal``: many short segments and a few near capacity;
- ``stress_mixes`` (reported apart): wide uniform lengths, where pairing long segments matters most.

Packers are compared like for like. ``offline`` (every length known up front): ``ours`` is
:func:`plan_rows`, ``fifo`` next-fit in arrival order, ``binpacking`` ``binpacking.to_constant_volume``.
``streamed`` (a step's worth of segments arrives per step, one row leaves per step, then the rest
drains): ``ours`` streams through :class:`CarryBuffer` (oldest pinned); ``ours_as_trainer`` takes
rows as the trainer does (``CarryBuffer.take_rows``: at least one per step, more while a row's worth
would wait, then a drain at the end);
``fifo`` takes the waiting segments in arrival order while they fit; ``binpacking`` packs everything
waiting and emits the fullest bin (no age bound: see its ``max_wait_steps``);
``one_row_per_step_bound`` is the fewest rows ANY packer can reach under the same arrivals (a step
cannot pack tokens that have not arrived). ``rows_over_lower_bound`` = rows / ceil(total tokens /
capacity); ``mean_fill`` = tokens / (rows * capacity). ``checks`` evaluates the acceptance rules.

Speed: the same real samples trained (forward + backward, one thread) as packed rows vs right-padded
batches of the same number of samples per step (arrival order), and vs one sample per step; tokens/s
counts real (non-padding) tokens. ``selection_cost`` sets the selection CPU time per row (worst mix)
against one forward + backward of a packed row.

Run: ``.venv/bin/python bench/packing.py [--data DIR] [--seed N] [--smoke]`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
from rollmatch.packing.binpack import fifo_greedy, plan_rows, select_row
from rollmatch.packing.carry import CarryBuffer
from rollmatch.packing.collate import enable_packed_attention, model_inputs, pack_row, pad_batch
from rollmatch.packing.segment import Segment, build_segment
from rollmatch.training.losses import weighted_ce_sum

DEFAULT_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
CAPACITY = TrainingConfig().global_max_length
CARRY_LIMIT = TrainingConfig().carry_buffer_size
SPEED_SAMPLES, SPEED_ROUNDS = 40, 2
# --smoke: every part on a few segments (seconds; numbers that only show the script runs).
SMOKE_SCALE = {
    "shapes": 12,
    "synthetic": 40,
    "stress": 20,
    "real_epochs": 1,
    "speed_samples": 4,
    "speed_rounds": 1,
}
FULL_SCALE = {"shapes": 600, "synthetic": 1500, "stress": 600, "real_epochs": 3}
FULL_SCALE |= {"speed_samples": SPEED_SAMPLES, "speed_rounds": SPEED_ROUNDS}
# Smallest setting (tests/test_benches.py runs it; docs/runbook.md "Benchmarks").
SMOKE_ARGS = "--smoke"
SMOKE_KEYS = ("distributions", "stress_mixes", "selection_cost", "packed_over_padded_tokens_per_s")
BUFFERED_ARRIVALS = 1.05  # tokens arriving per step / row capacity for the `ours` stream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", type=Path, default=DEFAULT_DATA, help="folder with raccoon/ and aquarium_combined_v2/"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--smoke", action="store_true", help="a few segments per part: checks the script runs"
    )
    args = parser.parse_args()
    scale = SMOKE_SCALE if args.smoke else FULL_SCALE
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model("qwen2_5_vl", Path(tmp) / "model")
        encoder = PromptEncoder.from_pretrained(model_dir, DataConfig(coord_frame="norm1000"))
        records = real_records(args.data)
        lengths = {
            "shapes": shapes_lengths(encoder, Path(tmp), n=scale["shapes"], seed=args.seed),
            "real": [
                lengths
                for _ in range(scale["real_epochs"])
                for lengths in rng.permutation(real_lengths(encoder, records)).tolist()
            ],
            "lognormal": lognormal_lengths(rng, n=scale["synthetic"]),
            # Its own generator: the draws of the mixes above and of the speed samples stay as they were.
            "bimodal": bimodal_lengths(np.random.default_rng(args.seed + 2), n=scale["synthetic"]),
        }
        result: dict[str, Any] = {
            "capacity": CAPACITY,
            "carry_buffer_size": CARRY_LIMIT,
            "distributions": {name: compare_packers(values, CAPACITY) for name, values in lengths.items()},
            "stress_mixes": {
                name: compare_packers(values, CAPACITY)
                for name, values in stress_lengths(
                    np.random.default_rng(args.seed + 1), n=scale["stress"]
                ).items()
            },
        }
        result.update(
            training_speed(model_dir, encoder, records, rng, scale["speed_samples"], scale["speed_rounds"])
        )
        result["selection_cost"] = selection_cost(result)
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


def bimodal_lengths(rng: np.random.Generator, n: int) -> list[int]:
    """Many short segments (median 120 tokens) and a few (8%) of 75-100% of a row."""
    near_capacity = rng.random(n) < 0.08
    short = np.clip(rng.lognormal(mean=math.log(120), sigma=0.5, size=n), 16, 600)
    long = rng.integers(int(0.75 * CAPACITY), CAPACITY + 1, size=n)
    return [int(v) for v in np.where(near_capacity, long, short)]


def stress_lengths(rng: np.random.Generator, n: int) -> dict[str, list[int]]:
    """Wide uniform lengths: half or more of them over half a row, so which segments share a row matters."""
    return {
        "uniform": [int(v) for v in rng.integers(16, CAPACITY + 1, size=n)],
        "uniform_10_70pct": [int(v) for v in rng.integers(CAPACITY // 10, 7 * CAPACITY // 10, size=n)],
    }


# -------------------------------------------------------------------------------------- row packing
def compare_packers(lengths: Sequence[int], capacity: int) -> dict[str, Any]:
    """Rows of each packer on one length mix, compared like for like (offline vs streamed)."""
    lower_bound = math.ceil(sum(lengths) / capacity)

    def summary(n_rows: int) -> dict[str, float]:
        return {
            "rows": n_rows,
            "rows_over_lower_bound": round(n_rows / lower_bound, 4),
            "mean_fill": round(sum(lengths) / (n_rows * capacity), 4),
        }

    start = time.process_time()
    ours_offline = plan_rows(lengths, capacity)
    plan_ms = (time.process_time() - start) * 1e3
    offline = {
        "ours": {**summary(len(ours_offline)), "plan_ms_per_row": round(plan_ms / len(ours_offline), 4)},
        # What the carry buffer's drain does (and plan_rows did before it tried largest-first plans).
        "oldest_pinned": summary(oldest_pinned_rows(lengths, capacity)),
        "fifo": summary(len(fifo_greedy(lengths, capacity))),
        "binpacking": summary(len(binpacking.to_constant_volume(list(lengths), capacity))),
    }

    def streamed(arrival_ratio: float, limit: int) -> dict[str, Any]:
        per_step = arrival_ratio * capacity / (sum(lengths) / len(lengths))
        ours = stream_through_carry(lengths, capacity, per_step, limit)
        trainer = stream_through_carry(lengths, capacity, per_step, limit, as_trainer=True)
        rows = {
            name: stream_rows(lengths, capacity, per_step, pick, limit)
            for name, pick in STREAMED_BASELINES.items()
        }
        bound = one_row_per_step_bound(lengths, capacity, per_step)
        return {
            "arrivals_over_capacity": arrival_ratio,
            "one_row_per_step_bound": summary(bound),
            "ours": {
                **summary(ours.rows),
                "rows_over_one_row_per_step_bound": ours.rows - bound,
                **ours.extras(),
            },
            "ours_as_trainer": {
                **summary(trainer.rows),
                "rows_over_one_row_per_step_bound": trainer.rows - bound,
                **trainer.extras(),
            },
            **{name: {**summary(run.rows), **run.extras()} for name, run in rows.items()},
        }

    result: dict[str, Any] = {
        "segments": len(lengths),
        "mean_length": round(sum(lengths) / len(lengths), 1),
        "max_length": max(lengths),
        "lower_bound_rows": lower_bound,
        "offline": offline,
        # Arrivals slightly above one row per step keep a reserve in the buffer to select from.
        "streamed": streamed(BUFFERED_ARRIVALS, limit=len(lengths)),
        # Arrivals of exactly one row per step under the default `training.carry_buffer_size`.
        "streamed_at_row_rate": streamed(1.0, limit=CARRY_LIMIT),
    }
    result["checks"] = packer_checks(result)
    return result


def oldest_pinned_rows(lengths: Sequence[int], capacity: int) -> int:
    """Rows of repeated :func:`select_row` on what is left."""
    remaining, rows = list(lengths), 0
    while remaining:
        picked = set(select_row(remaining, capacity))
        remaining = [length for i, length in enumerate(remaining) if i not in picked]
        rows += 1
    return rows


def packer_checks(result: dict[str, Any]) -> dict[str, bool]:
    """The acceptance rules, evaluated like for like: offline against offline, streamed against streamed."""
    offline, streamed = result["offline"], result["streamed"]
    return {
        "offline_ours_within_1_02": offline["ours"]["rows_over_lower_bound"] <= 1.02,
        "offline_ours_no_worse_than_baselines": all(
            offline["ours"]["rows"] <= offline[name]["rows"] for name in ("fifo", "binpacking")
        ),
        "streamed_ours_within_1_02": streamed["ours"]["rows_over_lower_bound"] <= 1.02,
        "streamed_as_trainer_within_1_02": streamed["ours_as_trainer"]["rows_over_lower_bound"] <= 1.02,
        "streamed_ours_no_worse_than_baselines": all(
            streamed["ours"]["rows"] <= streamed[name]["rows"] for name in STREAMED_BASELINES
        ),
    }


@dataclass
class StreamRun:
    """One streamed packing run: rows used, deepest wait queue, longest wait, selection time, and the
    first step with more waiting segments than the carry limit (None: never)."""

    rows: int = 0
    max_waiting: int = 0
    max_wait_steps: int = 0
    select_seconds: float = 0.0
    over_limit_at_step: int | None = None

    def extras(self) -> dict[str, float | None]:
        return {
            "over_carry_limit_at_step": self.over_limit_at_step,
            "max_waiting_segments": self.max_waiting,
            "max_wait_steps": self.max_wait_steps,
            "select_ms_per_row": round(self.select_seconds * 1e3 / max(self.rows, 1), 4),
        }


def arrival_steps(n_segments: int, per_step: float) -> list[range]:
    """Indices arriving at each step: ``per_step`` segments on average (whole segments; the fraction
    carries over), like a micro-step's rollouts."""
    steps, due, start = [], 0.0, 0
    while start < n_segments:
        due += per_step
        stop = min(start + int(due), n_segments)
        due -= int(due)
        steps.append(range(start, stop))
        start = stop
    return steps


def stream_through_carry(
    lengths: Sequence[int], capacity: int, per_step: float, limit: int, *, as_trainer: bool = False
) -> StreamRun:
    """Ours: the segments stream through :class:`CarryBuffer`, then it drains.

    One row per step (:meth:`CarryBuffer.next_row`), or with ``as_trainer`` the trainer's rule
    (:meth:`CarryBuffer.take_rows` with ``min_rows=1``: more rows while a row's worth of tokens or
    more than ``limit`` segments would wait). Without ``as_trainer`` the buffer is unbounded so every
    mix runs to the end; the first step at which more than ``limit`` segments waited (where
    ``next_row`` would raise) is reported instead.
    """
    buffer = CarryBuffer(capacity_tokens=capacity, max_segments=limit if as_trainer else len(lengths))
    run, arrived_at = StreamRun(), {}
    steps = arrival_steps(len(lengths), per_step)
    step = 0
    while step < len(steps) or len(buffer):
        arrivals = steps[step] if step < len(steps) else range(0)
        arrived_at.update({f"s{i}": step for i in arrivals})
        new = [length_only_segment(f"s{i}", lengths[i]) for i in arrivals]
        start = time.process_time()
        if as_trainer:
            rows = buffer.take_rows(new, min_rows=1, drain=step >= len(steps))
        else:
            rows = [row] if (row := buffer.next_row(new)) else []
        run.select_seconds += time.process_time() - start
        run.rows += len(rows)
        waits = [step - arrived_at[s.sample_id] for row in rows for s in row]
        run.max_wait_steps = max([run.max_wait_steps, *waits])
        run.max_waiting = max(run.max_waiting, len(buffer))
        if len(buffer) > limit and run.over_limit_at_step is None:
            run.over_limit_at_step = step
        step += 1
    return run


def stream_rows(
    lengths: Sequence[int],
    capacity: int,
    per_step: float,
    pick: Callable[[list[int], int], list[int]],
    limit: int,
) -> StreamRun:
    """A baseline under the same arrivals: ``pick`` chooses one row from the waiting lengths per step."""
    waiting: list[tuple[int, int]] = []  # (arrival step, segment index), oldest first
    run = StreamRun()
    steps = arrival_steps(len(lengths), per_step)
    step = 0
    while step < len(steps) or waiting:
        waiting += [(step, i) for i in (steps[step] if step < len(steps) else ())]
        if waiting:
            picked = set(pick([lengths[i] for _, i in waiting], capacity))
            run.rows += 1
            run.max_wait_steps = max([run.max_wait_steps, *(step - waiting[j][0] for j in picked)])
            waiting = [w for j, w in enumerate(waiting) if j not in picked]
            run.max_waiting = max(run.max_waiting, len(waiting))
            if len(waiting) > limit and run.over_limit_at_step is None:
                run.over_limit_at_step = step
        step += 1
    return run


def fifo_row(lengths: list[int], capacity: int) -> list[int]:
    """Streamed next-fit: the waiting segments in arrival order until the next one does not fit."""
    return fifo_greedy(lengths, capacity)[0]


def binpacking_row(lengths: list[int], capacity: int) -> list[int]:
    """Streamed ``binpacking``: pack everything waiting, emit the fullest bin (no age bound)."""
    bins = binpacking.to_constant_volume(dict(enumerate(lengths)), capacity)
    return sorted(max(bins, key=lambda b: (sum(b.values()), -min(b))))


STREAMED_BASELINES: dict[str, Callable[[list[int], int], list[int]]] = {
    "fifo": fifo_row,
    "binpacking": binpacking_row,
}


def one_row_per_step_bound(lengths: Sequence[int], capacity: int, per_step: float) -> int:
    """Fewest rows ANY packer can use when it emits one row per step under these arrivals, then drains.

    A step with arrivals has something waiting, so it emits a row; by step t at most
    min(tokens arrived by t, what fits in the rows so far) tokens can have left; what is left after the
    last arrival needs at least ceil(left / capacity) more rows.
    """
    arrived = left = rows = 0
    for arrivals in arrival_steps(len(lengths), per_step):
        arrived += sum(lengths[i] for i in arrivals)
        left = min(left + capacity, arrived)
        rows += bool(arrivals)
    return rows + math.ceil((sum(lengths) - left) / capacity)


def length_only_segment(sample_id: str, length: int) -> Segment:
    ids = torch.zeros(length, dtype=torch.long)
    return Segment(sample_id, ids, torch.zeros(length), None, None, ids, ids.expand(3, -1))


# ------------------------------------------------------------------------------------ training speed
def training_speed(
    model_dir: Path,
    encoder: PromptEncoder,
    records: Sequence[Record],
    rng: np.random.Generator,
    samples: int,
    rounds: int,
) -> dict[str, Any]:
    """Tokens/s of forward + backward over the same samples: packed rows vs padded vs one per step."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.train()
    kernel_model = copy.deepcopy(model)
    enable_packed_attention(kernel_model)
    segments = [real_segment(model, encoder, records[i]) for i in rng.permutation(len(records))[:samples]]
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
    for round_index in range(rounds + 1):  # interleaved rounds; round 0 warms up
        for name, (runner, batches) in runs.items():
            elapsed = train_seconds(runner, batches)
            if round_index:
                seconds[name] = min(seconds[name], elapsed)
    speed = {name: tokens / value for name, value in seconds.items()}
    return {
        "packed_row_train_ms": round(seconds["packed"] * 1e3 / len(rows), 2),
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


def selection_cost(result: dict[str, Any]) -> dict[str, float]:
    """Selection time per row (worst mix) next to one forward + backward of a packed row."""
    mixes = result["distributions"].values()
    select_ms = max(
        m[kind]["ours"]["select_ms_per_row"] for m in mixes for kind in ("streamed", "streamed_at_row_rate")
    )
    plan_ms = max(m["offline"]["ours"]["plan_ms_per_row"] for m in mixes)
    train_ms = result["packed_row_train_ms"]
    return {
        "select_ms_per_row_worst_mix": select_ms,
        "plan_ms_per_row_worst_mix": plan_ms,
        "packed_row_train_ms": train_ms,
        "select_over_train_row": round(select_ms / train_ms, 5),
        "plan_over_train_row": round(plan_ms / train_ms, 5),
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
