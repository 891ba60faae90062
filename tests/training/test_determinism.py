"""One machine, one environment: the demo's pipeline run twice gives bit-identical losses, weights,
rollouts and predictions.

Machines of the same kind differ in their CPU kernels (docs/models.md), so the demo's figures differ
between machines (README, docs/runbook.md "Demo"); on one machine they must not move at all, or a
difference between two runs could not be told from noise.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from rollmatch.data.records import load_records
from rollmatch.demo import ROLLOUT_PHASE, SFT_PHASE, SHAPES, build_inputs, phase_config, with_model
from rollmatch.evaluation import run_eval
from rollmatch.training.entry import run_training

SMALL = [  # the demo's configs, a few steps on a few images with HF generate
    "custom.extra.rollout_matching.rollout_backend=hf",
    "custom.extra.rollout_matching.max_new_tokens=16",
    "training.per_device_train_batch_size=2",
    "training.logging_steps=1",
    "training.report_to=[]",
    "training.log_rollouts_every=1",
    "eval.max_samples=4",
]


def demo_phases(inputs: Path, run: Path) -> dict[str, Any]:
    """Stage-1 SFT, then rollout matching from it, then the evaluation of the result: what can differ."""
    sft = phase_config(inputs, SFT_PHASE, [*SMALL, "training.max_steps=3", f"training.output_dir={run}/sft"])
    first = run_training(sft)
    rollout = phase_config(
        inputs,
        ROLLOUT_PHASE,
        [
            *SMALL,
            "training.max_steps=2",
            "preflight.records=0",  # a 3-step stage-1 writes no list yet; the test is about determinism
            f"training.output_dir={run}/rollout",
            f"model.path={first.final_model_dir}",
        ],
    )
    second = run_training(rollout)
    predictions = run / "eval.jsonl"
    evaluation = run_eval(
        with_model(rollout, second.final_model_dir), load_records(sft.data.val_jsonl), str(predictions)
    )
    seen: dict[str, Any] = {
        "predictions": predictions.read_text(),
        "f1": evaluation.f1,
        "map": evaluation.map,
    }
    for name, result in (("sft", first), ("rollout", second)):
        seen[f"{name} log"] = [{k: v for k, v in h.items() if not _timing(k)} for h in result.log_history]
        weights = Path(result.final_model_dir, "model.safetensors").read_bytes()
        seen[f"{name} weights"] = hashlib.sha256(weights).hexdigest()
    seen["rollouts"] = [p.read_text() for p in sorted(Path(run, "rollout", "rollouts").glob("*.jsonl"))]
    return seen


def _timing(key: str) -> bool:
    return any(part in key for part in ("seconds", "per_s", "runtime"))


@pytest.mark.timeout(900)  # ~1 min on an idle 2-core machine; several times that on a loaded one
@pytest.mark.heavy
def test_the_demo_pipeline_twice_on_one_machine_is_bit_identical(tmp_path: Path) -> None:
    inputs = tmp_path / "inputs"
    build_inputs(inputs, shapes={**SHAPES, "n_train": 8, "n_val": 4})
    first = demo_phases(inputs, tmp_path / "first")
    second = demo_phases(inputs, tmp_path / "second")
    assert len(first["sft log"]) >= 3 and len(first["rollouts"]) == 2 and first["predictions"]
    for key, value in first.items():
        assert value == second[key], f"{key} differs between two runs"
