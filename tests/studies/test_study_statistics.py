"""The learning-signal study's statistics (studies/learning_signal.py, studies/compare_studies.py): the
numbers a verdict rests on, checked on hand-built per-image counts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from studies import compare_studies, learning_signal, study_statistics, units


def _counts(tp: list[int], fp: list[int], fn: list[int]) -> dict[str, list[int]]:
    return {"tp": tp, "fp": fp, "fn": fn}


def test_paired_bootstrap_of_a_run_against_itself_is_exactly_zero() -> None:
    run = _counts([3, 2, 4, 1], [0, 1, 0, 2], [1, 2, 0, 3])
    result = study_statistics.paired_bootstrap([run, run], [run, run], 200, np.random.default_rng(0))
    assert result == {"delta_f1": 0.0, "ci95": [0.0, 0.0], "per_seed": [0.0, 0.0]}


def test_paired_bootstrap_finds_a_gain_on_every_image_and_measures_it_per_seed() -> None:
    rng = np.random.default_rng(1)
    gts = rng.integers(3, 6, size=400)
    base = [_counts(list(gts - 1), [1] * 400, [1] * 400) for _ in range(3)]  # one miss, one FP per image
    better = [_counts(list(gts), [1] * 400, [0] * 400) for _ in range(3)]  # nothing missed
    result = study_statistics.paired_bootstrap(better, base, 500, np.random.default_rng(0))
    tp, n = float(gts.sum()), 400
    expected = 2 * tp / (2 * tp + n) - 2 * (tp - n) / (2 * (tp - n) + 2 * n)
    assert result["per_seed"] == [round(expected, 4)] * 3
    assert result["delta_f1"] == pytest.approx(expected, abs=1e-4)
    assert 0 < result["ci95"][0] <= expected <= result["ci95"][1]


def test_training_cost_counts_only_the_steps_each_finished_invocation_trained() -> None:
    # the first invocation resumed nothing and finished 500 steps; the second resumed from 500
    invocations = [
        {"seconds": 100.0, "cpu_seconds": 180.0, "global_step": 500, "start_step": 0},
        {"seconds": 300.0, "cpu_seconds": 220.0, "global_step": 1000, "start_step": 500},
    ]
    assert units.training_cost(invocations, 1000) == (400.0, 400.0)
    wall_only = [{k: v for k, v in line.items() if k != "cpu_seconds"} for line in invocations]
    assert units.training_cost(wall_only, 1000) == (400.0, None)


def test_equal_compute_takes_each_arms_cheapest_seed_in_cpu_seconds() -> None:
    def run(cpu: float, wall: float) -> dict[str, float]:
        return {"steps": 1000, "train_cpu_seconds": cpu, "train_seconds": wall}

    runs: dict[str, dict[int, dict[str, float]]] = {arm: {} for arm in learning_signal.ARMS}
    runs["sft"] = {0: run(200, 100), 1: run(400, 900)}  # seed 1 shared the machine
    runs["prefix_fn"] = {0: run(800, 4000), 1: run(600, 300)}
    runs["reordered_gt"] = {0: run(1000, 500)}
    steps, basis = learning_signal.equal_compute_steps(runs, 1000)
    assert basis == {"compute_basis": "train_cpu_seconds", "rollout_over_sft_cost_per_step": 4.0}
    assert steps == 4000  # (600 + 1000) / 2 / 200 per step


def _study(folder: Path, **settings: object) -> Path:
    folder.mkdir(parents=True)
    base = {"object_format": "qwen_json", "arms": ["sft"], "steps": 1000, "decide_at": [1000], "seeds": [0]}
    (folder / "settings.json").write_text(json.dumps({**base, **settings}))
    return folder


def _report(tp: list[int]) -> dict[str, object]:
    metrics = dict.fromkeys(compare_studies.METRICS, 0.5)
    return {**metrics, "per_image": _counts(tp, [0] * len(tp), [1] * len(tp))}


def test_compare_studies_pairs_the_arms_and_seeds_both_studies_ran(tmp_path: Path) -> None:
    coord = _study(tmp_path / "coord", object_format="coord_tokens", arms=["sft", "prefix_fn"], seeds=[0, 1])
    digits = _study(tmp_path / "digits", arms=["sft"])
    for folder, tp, seeds in ((coord, [2, 2], (0, 1)), (digits, [1, 1], (0,))):
        (folder / "arms" / "sft").mkdir(parents=True)
        for seed in seeds:
            run = {"evals": {"1000": {"report": _report(tp)}}}
            (folder / "arms" / "sft" / f"seed{seed}.json").write_text(json.dumps(run))
    result = compare_studies.compare_studies(coord, digits, 100)
    assert list(result["arms"]) == ["sft"]  # prefix_fn ran in one study only
    assert result["arms"]["sft"]["seeds"] == [0]
    assert result["arms"]["sft"]["1000"]["delta_f1"] == pytest.approx(2 * 2 / 5 - 2 * 1 / 3, abs=1e-4)
    assert "stage1_dev" not in result  # neither study has a gate result yet


def test_compare_studies_refuses_studies_that_saw_other_data(tmp_path: Path) -> None:
    coord = _study(tmp_path / "coord", object_format="coord_tokens", steps=500)
    digits = _study(tmp_path / "digits")
    with pytest.raises(SystemExit, match=r"differ in \['steps'\]"):
        compare_studies.compare_studies(coord, digits, 100)


def test_compare_studies_pairs_stage1_seeds_and_gives_a_seed_level_interval(tmp_path: Path) -> None:
    def study(name: str, fmt: str, stage1_seed: int, tp: int) -> Path:
        folder = _study(tmp_path / name, object_format=fmt, stage1_seed=stage1_seed)
        (folder / "gate.json").write_text(json.dumps({"dev": _report([tp] * 4)}))
        (folder / "arms" / "sft").mkdir(parents=True)
        run = {"evals": {"1000": {"report": _report([tp] * 4)}}}
        (folder / "arms" / "sft" / "seed0.json").write_text(json.dumps(run))
        return folder

    coord = [study("c0", "coord_tokens", 0, 3), study("c1", "coord_tokens", 1, 4)]
    digits = [study("d1", "qwen_json", 1, 2), study("d0", "qwen_json", 0, 1)]  # any order: paired by seed
    result = compare_studies.compare_studies(coord, digits, 100)
    assert result["stage1_seeds"] == [0, 1]
    per_seed = [round(2 * 3 / 7 - 2 * 1 / 3, 4), round(2 * 4 / 9 - 2 * 2 / 5, 4)]
    assert result["stage1_dev"]["per_seed"] == per_seed
    t_test = result["stage1_dev"]["t_test_over_stage1_seeds"]
    assert t_test["seeds"] == 2 and t_test["ci95"][0] < np.mean(per_seed) < t_test["ci95"][1]
    assert result["arms"]["sft"]["1000"]["per_seed"] == per_seed
    with pytest.raises(SystemExit, match="stage-1 seeds"):
        compare_studies.compare_studies(coord, digits[:1], 100)
