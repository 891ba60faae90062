"""`rollmatch demo` end to end on a handful of images and steps: table, summary, plots, pictures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from rollmatch.demo import SHAPES, control_note, format_table, run_demo, truncation_note


@pytest.mark.heavy
def test_demo_runs_every_phase_and_writes_its_pictures(tmp_path: Path) -> None:
    overrides = [
        "training.max_steps=2",
        "custom.extra.rollout_matching.rollout_backend=hf",
        "custom.extra.rollout_matching.max_new_tokens=16",
        "preflight.records=0",  # a 2-step stage-1 model is not ready for rollouts; the demo itself checks
        "training.report_to=[]",
    ]
    summary = run_demo(tmp_path, overrides, shapes={**SHAPES, "n_train": 16, "n_val": 5})
    assert list(summary["phases"]) == ["before", "sft", "rollout_matching_sft", "sft_control"]
    phases = summary["phases"]
    assert (
        phases["sft"]["steps"]
        == phases["rollout_matching_sft"]["steps"]
        == phases["sft_control"]["steps"]
        == 2
    )
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    table = format_table(summary)
    assert (
        "F1@.5" in table
        and "trunc" in table
        and len(table.splitlines()) == 7
        and "label_mode require" in table
        and "boxes as coord_tokens" in table
    )
    assert "truncated fraction" in truncation_note(summary)
    assert "at equal steps" in control_note(summary)
    grid = Image.open(tmp_path / "pictures.png")
    assert grid.width >= 4 * 320 and grid.height >= 4 * 320  # 4 rows (before + 3 phases) x 4 val images
    assert Image.open(tmp_path / "summary.png").width > 0
    recipe = json.loads((tmp_path / "inputs.json").read_text())
    assert recipe["model"]["rope_theta"] == 10.0 and recipe["shapes"]["n_train"] == 16
    assert recipe["model"]["coord_tokens"] and summary["object_format"] == "coord_tokens"


def test_truncation_note_blames_rollout_matching_only_for_a_rise_its_control_does_not_share() -> None:
    def note(sft: float, rollout: float, control: float) -> str:
        fractions = {"sft": sft, "rollout_matching_sft": rollout, "sft_control": control}
        return truncation_note({"phases": {k: {"truncated_frac": v} for k, v in fractions.items()}})

    assert "no rise" in note(0.02, 0.02, 0.0)
    assert "not rollout matching's" in note(0.0, 0.016, 0.016)
    assert "ROSE after rollout matching: 0.000 -> 0.031" in note(0.0, 0.031, 0.016)
