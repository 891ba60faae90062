"""Async actor-learner vs Channel-B ``micro`` mode against the same real rollout server.

Starts ``rollmatch serve --engine hf`` (its own process) on a tiny Qwen2.5-VL, then trains
``stage2_ab_training`` with ``b_ratio: 1.0`` and ``vllm.mode: server`` twice in this process: once with
``channel_b.mode: micro`` (each step rolls out, then learns: ``T_rollout + T_learn`` per step) and once
with ``channel_b.mode: async`` (an actor thread rolls out while the learner trains). Both runs have the
same accumulation steps, decode batch, rollout length, row length and model. The micro run takes
``--batch`` records per micro-batch (default 2) so that both runs train about as many samples per
packed row and per step: async packs fill rows from a continuous stream, so with one record per
micro-batch it would train twice the samples per step and the comparison would measure packing, not
overlap.

From the micro run: ``T_rollout`` (rollout seconds per step) and ``T_learn`` (the rest of the step:
targets, packing, weight sync, forward/backward), and the ideal overlap bound
``max(T_rollout, T_learn) / (T_rollout + T_learn)``: the step time a perfect overlap would reach, as a
fraction of the sequential step. The ratio that matters is ``fraction_of_ideal``: the measured speed-up
of rollout-matched training (Channel-B samples trained per second, async over micro) divided by the
ideal speed-up ``1 / bound``. 1.0 = perfect overlap.

Staleness (async run): ``stale_dropped_fraction`` is the fraction of rollouts the learner dropped as
stale (older than ``version_window`` when consumed), ``ver_lag_mean`` / ``ver_lag_max`` the version lag
of the packs it trained. ``--compare-admission`` repeats the async run with admission-time staleness
control off (``async.admission_control: false``), under ``async_without_admission_control``.

Prints ONE JSON object. Run: ``.venv/bin/python bench/async_overlap.py [--steps 16] [--text-hidden 256]
[--sync-every 1 --version-window 1 --compare-admission]``
(a few minutes on 2 CPU cores). On a machine this small the server and the learner share two cores, so
they slow each other down while overlapped; the JSON records the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import rollmatch  # noqa: F401  (environment workarounds)
from rollmatch.config.load import load_config_dict
from rollmatch.data.shapes import generate_shapes
from rollmatch.models.tiny import TinySize, build_tiny_model
from rollmatch.training.entry import run_training

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_process import free_port, start_server  # bench scripts share the server helper

WARMUP_STEPS = 2
# Smallest setting (tests/test_benches.py runs it; docs/runbook.md "Benchmarks").
SMOKE_ARGS = "--steps 3 --gas 1 --batch 1 --decode-batch 1 --max-new-tokens 4 --row-tokens 512 --text-hidden 64 --text-layers 1"
SMOKE_KEYS = (
    "async_over_micro_b_samples_per_s",
    "fraction_of_ideal",
    "stale_dropped_fraction",
    "micro",
    "async",
)


def train(
    root: Path,
    args: argparse.Namespace,
    model_dir: Path,
    train_jsonl: Path,
    port: int,
    mode: str,
    admission: bool = True,
) -> tuple[list[dict[str, Any]], float]:
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
                                "image_wire": args.image_wire,
                            },
                        },
                    }
                },
            },
            "stage2_ab": {
                "schedule": {"b_ratio": 1.0},
                "channel_b": {
                    "mode": mode,
                    "rollout_decode_batch_size": args.decode_batch,
                    "async": {
                        "queue_limit": 8,
                        "prefetch_target_packs": 2 * args.gas,
                        "version_window": args.version_window,
                        "sync_every_steps": args.sync_every,
                        "admission_control": admission,
                        "max_wait_s": args.max_wait_s,
                    },
                },
            },
            "preflight": {"records": 0},  # a benchmark, not a run: no readiness check of the start model
            "training": {
                "output_dir": str(root / f"train_{mode}_{'admission' if admission else 'no_admission'}"),
                "per_device_train_batch_size": args.batch,
                "gradient_accumulation_steps": args.gas,
                "max_steps": args.steps,
                "logging_steps": 1,  # every step's step/seconds is read back
                "packing": True,
                "global_max_length": args.row_tokens,
                "report_to": [],
                "save_steps": 10_000,
                "learning_rate": 1e-4,
            },
        }
    )
    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # HF prints its log lines; stdout is the JSON result
        history = run_training(cfg).log_history
    return [h for h in history if "loss" in h], time.perf_counter() - start


def micro_summary(steps: list[dict[str, Any]]) -> dict[str, float]:
    measured = steps[WARMUP_STEPS:]
    step_s = statistics.mean(h["step/seconds"] for h in measured)
    rollout_s = statistics.mean(h["rollout/seconds"] for h in measured)
    samples = statistics.mean(h["samples"] for h in measured)
    return {
        "step_seconds": step_s,
        "t_rollout": rollout_s,
        "t_learn": step_s - rollout_s,
        "b_samples_per_step": samples,
        "b_samples_per_s": samples / step_s,
        "segments_per_row": statistics.mean(h["packing/segments_per_row"] for h in measured),
    }


def async_summary(steps: list[dict[str, Any]]) -> dict[str, float]:
    measured = steps[WARMUP_STEPS:]
    seconds = sum(h["step/seconds"] for h in measured)
    b_steps = [h for h in measured if h["stage2_ab/step_kind_b"] == 1.0]
    b_samples = sum(h["samples"] for h in b_steps)
    last = steps[-1]
    trained = [h for h in steps if h.get("stage2_ab/async/packs_trained")]
    packs_trained = sum(h["stage2_ab/async/packs_trained"] for h in trained)
    lag_sum = sum(h["stage2_ab/async/ver_lag_mean"] * h["stage2_ab/async/packs_trained"] for h in trained)
    rollouts = last["stage2_ab/async/rollouts_total"]
    return {
        "stale_dropped_fraction": last["stage2_ab/async/rollouts_dropped_stale_total"] / max(rollouts, 1.0),
        "ver_lag_mean": lag_sum / max(packs_trained, 1.0),
        "ver_lag_max": max(
            (h["stage2_ab/async/ver_lag_max"] for h in steps if "stage2_ab/async/ver_lag_max" in h),
            default=0.0,
        ),
        "admission_wait_s_total": last["stage2_ab/async/admission_wait_s_total"],
        "rollouts_total": rollouts,
        "step_seconds": seconds / len(measured),
        "b_steps": len(b_steps),
        "measured_steps": len(measured),
        "b_samples_per_s": b_samples / seconds,
        "b_samples_per_b_step": b_samples / max(1, len(b_steps)),
        "segments_per_row": statistics.mean(h["packing/segments_per_row"] for h in b_steps),
        "packs_produced_total": last["stage2_ab/async/packs_produced_total"],
        "packs_trained_total": last["stage2_ab/async/packs_trained_total"],
        "drop_stale_total": last["stage2_ab/async/drop_stale_total"],
        "drop_oldest_total": last["stage2_ab/async/drop_oldest_total"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--gas", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument(
        "--batch",
        type=int,
        default=2,
        help="records per micro-batch in the micro run (async packs fill rows instead); 2 makes both runs "
        "train about as many samples per packed row",
    )
    parser.add_argument("--decode-batch", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--row-tokens", type=int, default=512)
    parser.add_argument("--version-window", type=int, default=2)
    parser.add_argument(
        "--sync-every", type=int, default=1, help="async: optimizer steps between weight syncs"
    )
    parser.add_argument(
        "--image-wire",
        choices=["png", "resized_bmp"],
        default="png",
        help="vllm.server.image_wire of both runs",
    )
    parser.add_argument(
        "--max-wait-s",
        type=float,
        default=0.0,
        help="async.max_wait_s: how long a B step waits for its packs",
    )
    parser.add_argument(
        "--compare-admission",
        action="store_true",
        help="also run async with admission control off (async.admission_control: false)",
    )
    parser.add_argument("--text-hidden", type=int, default=256)
    parser.add_argument("--text-layers", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)  # learner and server each get one of the machine's cores
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        size = TinySize(
            text_hidden=args.text_hidden, text_layers=args.text_layers, text_intermediate=2 * args.text_hidden
        )
        model_dir = build_tiny_model("qwen2_5_vl", root / "model", seed=0, size=size)
        data = generate_shapes(root / "shapes", n_train=256, n_val=0, size=112, seed=0)
        port = free_port()
        server = start_server(model_dir, port, root / "server.log")
        try:
            micro_steps, micro_wall = train(root, args, model_dir, data["train"], port, "micro")
            async_steps, async_wall = train(root, args, model_dir, data["train"], port, "async")
            if args.compare_admission:
                unadmitted, unadmitted_wall = train(
                    root, args, model_dir, data["train"], port, "async", admission=False
                )
        finally:
            server.terminate()
            server.wait(timeout=30)
    micro = micro_summary(micro_steps)
    overlapped = async_summary(async_steps)
    bound = max(micro["t_rollout"], micro["t_learn"]) / (micro["t_rollout"] + micro["t_learn"])
    speedup = overlapped["b_samples_per_s"] / micro["b_samples_per_s"]
    result = {
        "async_over_micro_b_samples_per_s": speedup,
        "ideal_async_over_micro": 1.0 / bound,
        "ideal_overlap_bound": bound,
        "fraction_of_ideal": speedup * bound,
        "stale_dropped_fraction": overlapped["stale_dropped_fraction"],
        "async_over_micro_steps_per_s": micro["step_seconds"] / overlapped["step_seconds"],
        "micro": {**micro, "wall_seconds": micro_wall},
        "async": {**overlapped, "wall_seconds": async_wall},
        "setup": {
            "model": f"tiny qwen2_5_vl (random init), text {args.text_layers}x{args.text_hidden}; hf-engine server",
            "steps": args.steps,
            "warmup_steps": WARMUP_STEPS,
            "gradient_accumulation_steps": args.gas,
            "micro_run_batch": args.batch,
            "rollout_decode_batch_size": args.decode_batch,
            "max_new_tokens": args.max_new_tokens,
            "global_max_length": args.row_tokens,
            "version_window": args.version_window,
            "sync_every_steps": args.sync_every,
            "max_wait_s": args.max_wait_s,
            "image_wire": args.image_wire,
            "threads": "learner 1, server 1",
            "cpu_count": os.cpu_count(),
            "load_average_1min_after": os.getloadavg()[0],
        },
    }
    if args.compare_admission:
        off = async_summary(unadmitted)
        result["async_without_admission_control"] = {
            **off,
            "wall_seconds": unadmitted_wall,
            "fraction_of_ideal": off["b_samples_per_s"] / micro["b_samples_per_s"] * bound,
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
