"""Rows per channel, packing that adapts to the data, the pre-flight size check, and exact resume with
waiting (carried) segments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from resolved_runs import cpu_run
from safetensors.torch import load_file

from rollmatch.collectives import LocalCollectives
from rollmatch.data.prompts import PromptEncoder
from rollmatch.detection.object_formats import build_codec
from rollmatch.errors import ConfigError
from rollmatch.rollout.hf import HFBackend
from rollmatch.training import variants
from rollmatch.training.entry import run_training
from rollmatch.training.trainer import RollmatchTrainer
from rollmatch.training.variants import BuildContext, build_stage2


def test_a_and_b_rows_never_share_a_carry(loaded_tiny, tiny_model_dir, make_config, monkeypatch) -> None:
    # Rows of ~1.5 segments: every step leaves segments waiting; they must wait for their own channel.
    model, _ = loaded_tiny
    cfg = make_config(
        {
            "custom": {
                "trainer_variant": "stage2_ab_training",
                "extra": {"rollout_matching": {"max_new_tokens": 8}},
            },
            "stage2_ab": {"schedule": {"b_ratio": 0.5}, "channel_b": {"rollout_decode_batch_size": 4}},
            "training": {"global_max_length": 400},
        }
    )
    encoder = PromptEncoder.from_pretrained(str(tiny_model_dir), cfg.data)
    backend = HFBackend(
        model, encoder.tokenizer, eos_token_id=encoder.eos_token_id, pad_token_id=encoder.pad_token_id
    )
    monkeypatch.setattr(variants, "backend_for", lambda ctx: backend)
    from rollmatch.data.records import load_records

    records = load_records(cfg.data.train_jsonl)
    ctx = BuildContext(
        run=cpu_run(cfg, gradient_accumulation_steps=2),
        model=model,
        encoder=encoder,
        codec=build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id]),
        collectives=LocalCollectives(),
    )
    parts = build_stage2(ctx)
    channel_a, channel_b = parts.stateful["channel_a"], parts.stateful["channel_b"]
    windows = [records[:2], records[2:4]]
    plan_a = parts.planner.plan(windows, 0)  # b_ratio 0.5: A
    carried_a = list(channel_a.rows.carry.waiting)
    assert plan_a.kind == "A" and carried_a, "the A step should leave segments waiting"
    trained_b: list[str] = []
    batch_b = channel_b.rows.batch

    def recording_batch(row: Any) -> Any:
        trained_b.extend(segment.sample_id for segment in row)
        return batch_b(row)

    channel_b.rows.batch = recording_batch
    plan_b = parts.planner.plan([records[4:6], records[6:8]], 1)  # B
    assert plan_b.kind == "B"
    assert list(channel_a.rows.carry.waiting) == carried_a  # untouched by the B step
    assert trained_b and set(trained_b) <= {r.id for r in records[4:8]}  # only this step's rollouts
    assert len(trained_b) + len(channel_b.rows.carry) == 4


def shapes_config(make_config: Any, out: Path, **training: Any) -> Any:
    return make_config(
        {
            "custom": {"trainer_variant": "sft"},
            "training": {
                "output_dir": str(out),
                "per_device_train_batch_size": 4,
                "global_max_length": 300,  # about two segments: a micro-batch of 4 needs two rows
                "learning_rate": 1e-3,
                "seed": 3,
                **training,
            },
        }
    )


@pytest.mark.heavy
def test_packing_adapts_when_a_micro_batch_brings_more_than_a_row(make_config, tmp_path) -> None:
    # Each step brings about two rows' worth: a buffer that took one row per step would overflow.
    result = run_training(shapes_config(make_config, tmp_path / "out", max_steps=6))
    logs = [h for h in result.log_history if "loss" in h]
    assert result.global_step == 6
    assert max(h["packing/rows"] for h in logs) >= 2  # extra rows in a step instead of an overflow error
    assert sum(h["packing/rows"] for h in logs) >= 6
    assert all(h["packing/fill_ratio"] <= 1.0 for h in logs)
    trained = sum(h["packing/rows"] * h["packing/segments_per_row"] for h in logs)
    assert trained == pytest.approx(6 * 4)  # every sample trained by the end: the last step drains


def test_a_sample_that_cannot_fit_a_row_fails_before_the_first_step(make_config, tmp_path) -> None:
    cfg = shapes_config(make_config, tmp_path / "out", max_steps=2, global_max_length=40)
    with pytest.raises(
        ConfigError,
        match=r"training\.global_max_length = 40: \d+ of \d+ training records need more than 40 tokens",
    ):
        run_training(cfg)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


class SimulatedCrash(RuntimeError):
    pass


@pytest.mark.heavy
def test_resume_with_waiting_segments_equals_an_uninterrupted_run(make_config, tmp_path, monkeypatch) -> None:
    # (A run that reaches max_steps trains what still waits on its last step; a crash does not.)
    def config(out: Path, resume: str | None = None) -> Any:
        return shapes_config(
            make_config,
            out,
            max_steps=4,
            per_device_train_batch_size=3,
            global_max_length=400,
            save_steps=2,
            resume_from_checkpoint=resume,
        )

    straight = run_training(config(tmp_path / "straight"))

    save = RollmatchTrainer._save_checkpoint

    def crash_after_first_checkpoint(self: RollmatchTrainer, model: Any, trial: Any) -> None:
        save(self, model, trial)
        raise SimulatedCrash(f"killed after checkpoint {self.state.global_step}")

    with monkeypatch.context() as patch:
        patch.setattr(RollmatchTrainer, "_save_checkpoint", crash_after_first_checkpoint)
        with pytest.raises(SimulatedCrash, match="checkpoint 2"):
            run_training(config(tmp_path / "resumed"))
    state = torch.load(tmp_path / "resumed" / "checkpoint-2" / "rollmatch_state_rank0.pt", weights_only=True)
    assert state["channel_a"]["segments"], "the checkpoint should hold waiting segments"
    resumed = run_training(config(tmp_path / "resumed", resume="latest"))

    def losses(result: Any) -> list[float]:
        return [h["loss"] for h in result.log_history if "loss" in h]

    assert losses(resumed)[-2:] == pytest.approx(losses(straight)[-2:], rel=1e-5)
    final_straight = load_file(Path(straight.final_model_dir) / "model.safetensors")
    final_resumed = load_file(Path(resumed.final_model_dir) / "model.safetensors")
    for name, tensor in final_straight.items():
        assert torch.allclose(tensor, final_resumed[name], rtol=1e-5, atol=1e-6), name
