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
    )
    assert "truncated fraction" in truncation_note(summary)
    assert "at equal steps" in control_note(summary)
    grid = Image.open(tmp_path / "pictures.png")
    assert grid.width >= 4 * 320 and grid.height >= 4 * 320  # 4 rows (before + 3 phases) x 4 val images
    assert Image.open(tmp_path / "summary.png").width > 0
    recipe = json.loads((tmp_path / "inputs.json").read_text())
    assert recipe["model"]["rope_theta"] == 10.0 and recipe["shapes"]["n_train"] == 16
