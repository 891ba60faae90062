"""Stage-2 AB end to end through HF's loop on a tiny real model: the schedule across a resume, one
kind per optimizer step, and Channel-B step mode (budget, rows, one update, rollouts before training)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rollmatch.training import variants
from rollmatch.training.entry import run_training
from rollmatch.training.schedule import step_kind
from rollmatch.training.step import MicroStep
from rollmatch.training.trainer import RollmatchTrainer

FAST_ROLLOUTS = {
    "custom": {"trainer_variant": "stage2_ab_training", "extra": {"rollout_matching": {"max_new_tokens": 8}}}
}


def step_logs(result: Any) -> list[dict[str, Any]]:
    return [h for h in result.log_history if "loss" in h]


@pytest.mark.heavy
def test_resumed_run_continues_the_schedule_with_one_kind_per_window(make_config):
    # b_ratio 0.34 gives A, A, B, A: a schedule restarted from 0 after the resume would give A, A.
    def config(max_steps: int, resume: str | None = None) -> Any:
        return make_config(
            {
                **FAST_ROLLOUTS,
                "stage2_ab": {"schedule": {"b_ratio": 0.34}},
                "training": {
                    "per_device_train_batch_size": 1,
                    "gradient_accumulation_steps": 2,
                    "max_steps": max_steps,
                    "save_steps": 2,
                    "resume_from_checkpoint": resume,
                },
            }
        )

    first = run_training(config(2))
    resumed = run_training(config(4, resume="latest"))
    logs = step_logs(first) + step_logs(resumed)[-2:]
    assert [h["step"] for h in logs] == [1, 2, 3, 4]
    assert ["B" if h["stage2_ab/step_kind_b"] else "A" for h in logs] == [
        step_kind(s, 0.34) for s in range(4)
    ]
    assert [step_kind(s, 0.34) for s in range(4)] == ["A", "A", "B", "A"]
    for h in logs:
        ran, other = ("b", "a") if h["stage2_ab/step_kind_b"] else ("a", "b")
        assert h[f"stage2_ab/micro_steps_{ran}"] == 2  # both micro-steps of the window ran that kind
        assert f"stage2_ab/micro_steps_{other}" not in h
        assert h[f"stage2_ab/loss_{ran}"] == pytest.approx(h["loss"], rel=1e-5)
        assert ("rollout/count" in h) == (ran == "b")  # Channel-A never rolls out
    assert logs[2]["stage2_ab/rollouts"] == 2
    assert logs[2]["stage2_ab/b_ratio_realized"] == pytest.approx(1 / 3)


@pytest.fixture(scope="module")
def shapes_32(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from rollmatch.data.shapes import generate_shapes

    return generate_shapes(tmp_path_factory.mktemp("shapes32"), n_train=32, n_val=0, size=112, seed=1)


class MicroStepCounter:
    """Counts the trainer's micro-steps and when rollout calls happened."""

    def __init__(self) -> None:
        self.micro_steps = 0
        self.rollout_calls: list[tuple[int, int]] = []  # (micro-steps run before the call, requests)


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("training", "decode_batch", "budget", "window"),
    [
        ({"effective_batch_size": 32}, 8, 32, 32),  # GAS 32, default budget 1 * 1 * 32
        ({"gradient_accumulation_steps": 8}, 2, 8, 8),
    ],
    ids=["eff32", "gas8"],
)
def test_step_mode_learns_its_budget_on_the_last_micro_step(
    make_config, shapes_32, monkeypatch, training, decode_batch, budget, window
):
    counter = MicroStepCounter()
    original_step = RollmatchTrainer.training_step

    def counting_step(self: RollmatchTrainer, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        if isinstance(inputs, MicroStep):
            counter.micro_steps += 1
        return original_step(self, model, inputs, num_items_in_batch)

    original_backend_for = variants.backend_for

    def recording_backend(ctx: Any) -> Any:
        backend = original_backend_for(ctx)
        generate = backend.generate

        def record(requests: Any, decoding: Any, seed: int) -> Any:
            counter.rollout_calls.append((counter.micro_steps, len(requests)))
            return generate(requests, decoding, seed)

        backend.generate = record
        return backend

    monkeypatch.setattr(RollmatchTrainer, "training_step", counting_step)
    monkeypatch.setattr(variants, "backend_for", recording_backend)
    cfg = make_config(
        {
            **FAST_ROLLOUTS,
            "data": {"train_jsonl": str(shapes_32["train"]), "val_jsonl": None},
            "stage2_ab": {
                "schedule": {"b_ratio": 1.0},
                "channel_b": {"mode": "step", "rollout_decode_batch_size": decode_batch},
            },
            # Rows of 512 tokens hold several rollout segments (~130-170 tokens each).
            "training": {
                "per_device_train_batch_size": 1,
                "max_steps": 1,
                "global_max_length": 512,
                **training,
            },
        }
    )
    result = run_training(cfg)
    (log,) = step_logs(result)
    assert result.global_step == 1  # exactly one optimizer update
    assert counter.micro_steps == window
    # The spec: the earlier micro-steps buffer; the whole budget is rolled out in the last micro-step
    # (after window - 1 micro-steps ran), then learned to completion in it.
    assert {micro_step for micro_step, _ in counter.rollout_calls} == {window}
    assert [size for _, size in counter.rollout_calls] == [decode_batch] * (budget // decode_batch)
    assert log["rollout/count"] == budget == log["stage2_ab/rollouts"]
    assert log["samples"] == budget
    assert 1 <= log["packing/rows"] < budget  # several segments per row
    assert log["packing/rows"] == log["stage2_ab/step/forward_passes"]
    assert log["packing/segments_per_row"] > 1
    assert log["stage2_ab/micro_steps_b"] == window
    assert log["stage2_ab/loss_b"] == pytest.approx(log["loss"], rel=1e-5)
