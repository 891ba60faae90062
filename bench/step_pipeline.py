"""Channel-B step mode against a real rollout server: the in-step pipeline on vs off.

Starts ``rollmatch serve --engine hf`` on the tiny Qwen2.5-VL model (its own process, one CPU
thread), then trains stage2_ab_training with ``b_ratio: 1.0``, ``channel_b.mode: step`` and
``vllm.mode: server`` twice, once per ``enable_pipeline`` value (learner: one CPU thread). Each
optimizer step rolls out ``--rollouts-per-step`` samples (16) in decode batches of ``DECODE_BATCH`` and
learns every segment. The first of the ``--steps`` (8) of each run is a warm-up and is not measured.

Prints ONE JSON object: ``pipeline_on_over_off_step_time`` (mean B-loop wall time per optimizer
step, on / off), ``learner_wait_fraction`` (pipeline on: the fraction of the step the learner spent
waiting for rollouts), the same wait fraction without the pipeline, and the raw per-step seconds.
Run: ``.venv/bin/python bench/step_pipeline.py [--steps 8] [--rollouts-per-step 16] [--max-new-tokens 16]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import rollmatch  # noqa: F401  (environment workarounds)
from rollmatch.config.load import load_config_dict
from rollmatch.data.shapes import generate_shapes
from rollmatch.models.tiny import build_tiny_model
from rollmatch.training.entry import run_training

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_process import free_port, start_server  # bench scripts share the server helper

ROLLOUTS_PER_STEP = 16
DECODE_BATCH = 2
MAX_NEW_TOKENS = 16
STEPS = 8  # the first is a warm-up
# Smallest setting (tests/test_benches.py runs it; docs/runbook.md "Benchmarks").
SMOKE_ARGS = "--steps 2 --rollouts-per-step 2 --max-new-tokens 4"
SMOKE_KEYS = ("pipeline_on_over_off_step_time", "learner_wait_fraction", "pipeline_on", "pipeline_off")


def train(
    root: Path, model_dir: Path, train_jsonl: Path, port: int, pipeline: bool, args: argparse.Namespace
) -> list[dict[str, Any]]:
    cfg = load_config_dict(
        {
            "model": {"path": str(model_dir)},
            "data": {"train_jsonl": str(train_jsonl), "val_jsonl": None, "coord_frame": "norm1000"},
            "custom": {
                "trainer_variant": "stage2_ab_training",
                "extra": {
                    "rollout_matching": {
                        "rollout_backend": "vllm",
                        "max_new_tokens": args.max_new_tokens,
                        "vllm": {
                            "mode": "server",
                            "server": {
                                "servers": [
                                    {"base_url": f"http://127.0.0.1:{port}", "group_port": free_port()}
                                ],
                                "timeout_s": 120.0,
                                "infer_timeout_s": 300.0,
                            },
                        },
                    }
                },
            },
            "stage2_ab": {
                "schedule": {"b_ratio": 1.0},
                "channel_b": {
                    "mode": "step",
                    "rollouts_per_step": args.rollouts_per_step,
                    "rollout_decode_batch_size": DECODE_BATCH,
                    "enable_pipeline": pipeline,
                },
            },
            "preflight": {"records": 0},  # a benchmark, not a run: no readiness check of the start model
            "training": {
                "output_dir": str(root / f"train_pipeline_{pipeline}"),
                "per_device_train_batch_size": 1,
                "max_steps": args.steps,
                "logging_steps": 1,  # every step's metrics are read back
                "packing": True,
                "global_max_length": 384,
                "report_to": [],
                "save_steps": 10_000,
                "learning_rate": 1e-4,
            },
        }
    )
    with contextlib.redirect_stdout(sys.stderr):  # HF prints its log lines; stdout is the JSON result
        history = run_training(cfg).log_history
    return [h for h in history if "stage2_ab/step/seconds" in h]


def summary(steps: list[dict[str, Any]]) -> dict[str, float]:
    measured = steps[1:]  # the first step warms caches up
    seconds = [h["stage2_ab/step/seconds"] for h in measured]
    waits = [h["stage2_ab/step/learner_wait_s"] for h in measured]
    return {
        "step_seconds_mean": statistics.mean(seconds),
        "step_seconds_median": statistics.median(seconds),
        "learner_wait_seconds_mean": statistics.mean(waits),
        "learner_wait_fraction": sum(waits) / sum(seconds),
        "rows_per_step": statistics.mean(h["packing/rows"] for h in measured),
        "step_seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=STEPS, help="optimizer steps per run (the first warms up)"
    )
    parser.add_argument("--rollouts-per-step", type=int, default=ROLLOUTS_PER_STEP)
    parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is a warm-up)")
    torch.set_num_threads(1)  # learner and server each get one of the machine's cores
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = build_tiny_model("qwen2_5_vl", root / "model", seed=0)
        data = generate_shapes(root / "shapes", n_train=32, n_val=0, size=112, seed=0)
        port = free_port()
        server = start_server(model_dir, port, root / "server.log")
        try:
            off = summary(train(root, model_dir, data["train"], port, pipeline=False, args=args))
            on = summary(train(root, model_dir, data["train"], port, pipeline=True, args=args))
        finally:
            server.terminate()
            server.wait(timeout=30)
    result = {
        "pipeline_on_over_off_step_time": on["step_seconds_mean"] / off["step_seconds_mean"],
        "learner_wait_fraction": on["learner_wait_fraction"],
        "learner_wait_fraction_pipeline_off": off["learner_wait_fraction"],
        "pipeline_on": on,
        "pipeline_off": off,
        "setup": {
            "model": "tiny qwen2_5_vl (random init), HF-engine rollout server",
            "rollouts_per_step": args.rollouts_per_step,
            "rollout_decode_batch_size": DECODE_BATCH,
            "max_new_tokens": args.max_new_tokens,
            "measured_steps": args.steps - 1,
            "threads": "learner 1, server 1",
            "cpu_count": os.cpu_count(),
            "load_average_1min_after": os.getloadavg()[0],
        },
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
