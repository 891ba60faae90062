"""studies/grpo_signal.py: its statistics on hand-made numbers, its settings guard, and (heavy) one run end to end
at its smallest setting, resumed without recomputing anything."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from studies import grpo_signal, study_statistics

REPO = Path(__file__).resolve().parents[2]


def test_paired_bootstrap_interval_excludes_zero_only_for_a_consistent_rise() -> None:
    rng = np.random.default_rng(0)
    before = list(rng.uniform(0.2, 0.6, 64))
    rose = [b + 0.05 + d for b, d in zip(before, rng.normal(0, 0.02, 64), strict=True)]
    noise = [b + d for b, d in zip(before, rng.normal(0, 0.05, 64), strict=True)]
    up = study_statistics.paired_mean_bootstrap(rose, before, 500, np.random.default_rng(1))
    assert up["ci95"][0] > 0 and abs(up["delta"] - 0.05) < 0.01
    assert up["images_up"] + up["images_down"] == 64
    flat = study_statistics.paired_mean_bootstrap(noise, before, 500, np.random.default_rng(1))
    assert flat["ci95"][0] < 0 < flat["ci95"][1]


def test_paired_bootstrap_is_paired_per_image() -> None:
    """Large spread between images, the same +0.1 on each: an unpaired interval would straddle 0."""
    before = [0.0, 0.9, 0.1, 0.8, 0.2, 0.7]
    delta = study_statistics.paired_mean_bootstrap(
        [b + 0.1 for b in before], before, 200, np.random.default_rng(0)
    )
    assert delta["ci95"] == [0.1, 0.1] and delta["delta"] == 0.1


def test_paired_bootstrap_refuses_unpaired_lists() -> None:
    with pytest.raises(ValueError, match="equal non-empty"):
        study_statistics.paired_mean_bootstrap([0.1, 0.2], [0.1], 10, np.random.default_rng(0))


def test_curve_ends_never_overlap() -> None:
    assert grpo_signal.curve_ends([0.1, 0.2, 0.3, 0.4], 10) == (0.15, 0.35)
    assert grpo_signal.curve_ends([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 2) == (1.5, 5.5)
    assert grpo_signal.curve_ends([0.5], 10) == (0.5, 0.5)
    assert grpo_signal.curve_ends([], 10) == (None, None)


def _eval(f1: float) -> dict[str, Any]:
    return {"f1": f1, "map": f1 / 2, "truncated_frac": 0.0, "invalid": {}}


def test_verdict_needs_the_interval_above_zero_and_f1_kept() -> None:
    rose = {"ci95": [0.01, 0.05]}
    assert grpo_signal.verdict(rose, _eval(0.6), _eval(0.58))["works"]
    collapsed = grpo_signal.verdict(rose, _eval(0.6), _eval(0.6 - grpo_signal.F1_SLACK - 0.01))
    assert collapsed["reward_rose"] and not collapsed["f1_kept"] and not collapsed["works"]
    assert not grpo_signal.verdict({"ci95": [0.0, 0.05]}, _eval(0.6), _eval(0.7))["works"]


def test_an_out_folder_of_other_settings_is_refused(tmp_path: Path) -> None:
    grpo_signal.check_settings(tmp_path, grpo_signal.parse_args(["--out", str(tmp_path), "--steps", "4"]))
    with pytest.raises(SystemExit, match=r"other settings \(\['steps'\]"):
        grpo_signal.check_settings(tmp_path, grpo_signal.parse_args(["--out", str(tmp_path), "--steps", "5"]))


@pytest.mark.bench
@pytest.mark.timeout(900)
def test_the_bench_runs_end_to_end_at_its_smallest_setting_and_resumes(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "studies.grpo_signal",
        *shlex.split(grpo_signal.SMOKE_ARGS.format(tmp=tmp_path)),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def run() -> dict[str, Any]:
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-4000:]
        return json.loads(done.stdout)  # the trainer's prints go to stderr: stdout is the JSON alone

    first = run()
    assert set(grpo_signal.SMOKE_KEYS) <= set(first)
    assert first["grpo"]["steps"] == 2 and len(first["grpo"]["reward_curve"]) == 2
    for side in ("reward_before", "reward_after"):
        assert len(first[side]["per_image"]) == 2 and first[side]["samples"] == 4
        assert first[side]["temperature"] == 1.0
    assert first["reward_delta"]["images"] == 2
    assert first["eval_before"]["decoding"]["temperature"] == 0.0
    out = tmp_path / "grpo_signal"
    units = {
        p: p.stat().st_mtime_ns
        for p in out.glob("*.json")
        if p.name not in ("grpo_signal.json", "settings.json", "inputs.json")
    }
    assert {p.name for p in units} >= {"stage1.json", "reward_before.json", "grpo.json", "eval_after.json"}
    for model in ("sft", "grpo"):  # neither stage-1 nor GRPO is trained again
        config = out / model / "final" / "config.json"
        units[config] = config.stat().st_mtime_ns
    again = run()
    assert again["reward_delta"] == first["reward_delta"] and again["grpo"] == first["grpo"]
    assert {p: p.stat().st_mtime_ns for p in units} == units  # nothing recomputed
