"""Cost of logging rollouts while training (``training.log_rollouts_every``), per logged step.

Measures :class:`rollmatch.training.rollout_log.RolloutLog` as the trainer calls it: ``rolled_out`` after
every rollout call (every step, rank 0: remember which rollout made which segment) and ``trained`` at a
logged step (score again, draw, PNG, JSONL, TensorBoard images through a real ``SummaryWriter``). Inputs:
the demo's shapes (224 px, 1-2 shapes of 60-110 px, noisy backgrounds) and a tiny model's processor; each
rollout answers one GT box right and one false positive, so every picture has all three kinds of box.
Wall and CPU seconds (process CPU: the TensorBoard writer's thread counts) are reported; on a shared machine
CPU is the figure to compare.

Prints one JSON object: ``rolled_out_ms_per_rollout`` (wall / cpu) and ``trained_s_per_logged_step``
(median wall / cpu over ``--steps`` logged steps of ``--count`` rollouts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

SMOKE_ARGS = "--steps 2 --count 2 --records 4"
SMOKE_KEYS = ["rolled_out_ms_per_rollout", "trained_s_per_logged_step", "settings"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="logged steps measured")
    parser.add_argument("--count", type=int, default=4, help="rollouts per logged step (log_rollouts_count)")
    parser.add_argument("--records", type=int, default=32, help="records rolled out per step")
    args = parser.parse_args()

    import torch
    from torch.utils.tensorboard import SummaryWriter

    from rollmatch.config.load import load_config_dict
    from rollmatch.data.prompts import PromptEncoder
    from rollmatch.data.records import load_records
    from rollmatch.data.shapes import ShapesDifficulty, generate_shapes
    from rollmatch.detection.object_formats import build_codec
    from rollmatch.detection.objects import DetObject
    from rollmatch.models.tiny import build_tiny_model
    from rollmatch.packing.segment import Segment
    from rollmatch.rollout.types import Decoding, Rollout, RolloutProvenance
    from rollmatch.training.rollout_log import RolloutLog

    root = Path(tempfile.mkdtemp(prefix="rollout_log_bench_"))
    build_tiny_model("qwen2_5_vl", root / "model", seed=0)
    difficulty = ShapesDifficulty(max_objects=2, min_side=60, max_side=110)
    data = generate_shapes(
        root / "data", n_train=args.records, n_val=0, size=224, seed=0, difficulty=difficulty
    )
    cfg = load_config_dict(
        {
            "model": {"path": str(root / "model")},
            "data": {"train_jsonl": str(data["train"]), "coord_frame": "norm1000"},
            "custom": {"trainer_variant": "rollout_matching_sft"},
            "preflight": {"records": 0},  # a benchmark, not a run: no readiness check of the start model
            "training": {
                "output_dir": str(root / "out"),
                "report_to": ["tensorboard"],
                "log_rollouts_every": 1,
                "log_rollouts_count": args.count,
            },
        }
    )
    encoder = PromptEncoder.from_pretrained(str(root / "model"), cfg.data)
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    records = load_records(data["train"])
    writer = SummaryWriter(str(root / "out" / "runs"))

    class TensorBoardCallback:  # what the trainer's callback list holds: HF's keeps its writer here
        tb_writer = writer

    log = RolloutLog(cfg, encoder, codec, writers=lambda: [TensorBoardCallback])
    encoded = [encoder.encode(r) for r in records]
    rollouts, segments = [], []
    for record, enc in zip(records, encoded, strict=True):
        gts = encoder.gt_objects(record, enc)
        text = codec.serialize([gts[0], DetObject("fish", (10, 10, 200, 200))])
        ids = encoder.tokenizer.encode(text, add_special_tokens=False)
        provenance = RolloutProvenance(backend="hf", seed=0, decoding=Decoding())
        rollouts.append(Rollout(record.id, enc.input_ids, ids, text, "stop", 0, provenance))
        length = len(enc.input_ids) + len(ids)
        segments.append(
            Segment(
                sample_id=record.id,
                input_ids=torch.tensor(enc.input_ids + ids),
                weights=torch.ones(length),
                pixel_values=None,
                image_grid_thw=None,
                mm_token_type_ids=torch.zeros(length, dtype=torch.long),
                position_ids=torch.zeros(3, length, dtype=torch.long),
            )
        )
    calls = 10
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        log.rolled_out(records, encoded, rollouts, segments)
    per_rollout = (time.perf_counter() - wall, time.process_time() - cpu)
    logged = []
    for step in range(args.steps):
        start = (step * args.count) % len(segments)
        wall, cpu = time.perf_counter(), time.process_time()
        log.trained(step, segments[start : start + args.count])
        logged.append((time.perf_counter() - wall, time.process_time() - cpu))
    writer.close()
    rollouts_seen = calls * len(records)
    print(
        json.dumps(
            {
                "rolled_out_ms_per_rollout": {
                    "wall": round(per_rollout[0] / rollouts_seen * 1e3, 4),
                    "cpu": round(per_rollout[1] / rollouts_seen * 1e3, 4),
                },
                "trained_s_per_logged_step": {
                    "wall_median": round(statistics.median(w for w, _ in logged), 4),
                    "cpu_median": round(statistics.median(c for _, c in logged), 4),
                },
                "settings": {
                    "count": args.count,
                    "steps": args.steps,
                    "records": args.records,
                    "image_px": 224,
                },
            }
        )
    )


if __name__ == "__main__":
    main()
