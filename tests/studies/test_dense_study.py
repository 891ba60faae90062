"""The crowded-scenes study (studies/dense_study.py, studies/dense_summary.py, studies/study_rules.py): its
rules on hand-built counts, its resumability, and (heavy) one end-to-end run at absurdly small sizes."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy import stats

from studies import (
    dense_arms,
    dense_gate,
    dense_plot,
    dense_study,
    dense_summary,
    shapes_recipe,
    study_statistics,
    units,
)
from studies import study_rules as rules
from studies.study_protocols import CROWD_LOCKED

REPO = Path(__file__).resolve().parents[2]

# ------------------------------------------------------------------------------ count-oracle F1


def test_count_oracle_fixes_each_images_count_error_and_nothing_else() -> None:
    # over-counted (5 predictions, 4 GT), under-counted (2 predictions, 5 GT), exact (3 and 3)
    tp, fp, fn = [3, 2, 2], [2, 0, 1], [1, 3, 1]
    fixed = study_statistics.count_oracle_counts(np.array(tp), np.array(fp), np.array(fn))
    assert [list(a) for a in fixed] == [[3, 5, 2], [1, 0, 1], [1, 0, 1]]
    assert study_statistics.count_oracle_f1(tp, fp, fn) == pytest.approx(2 * 10 / (2 * 10 + 2 + 2), rel=1e-12)
    headroom = study_statistics.count_oracle_headroom({"tp": tp, "fp": fp, "fn": fn})
    assert headroom["f1"] == round(2 * 7 / (2 * 7 + 3 + 5), 4)
    assert headroom["headroom"] == pytest.approx(headroom["count_oracle_f1"] - headroom["f1"], abs=1e-4)


def test_count_oracle_of_exact_counts_is_the_f1_itself() -> None:
    counts = {"tp": [3, 0, 5], "fp": [1, 2, 0], "fn": [1, 2, 0]}  # wrong boxes, right counts
    assert study_statistics.count_oracle_headroom(counts)["headroom"] == 0.0
    with pytest.raises(ValueError, match=">= 0"):
        study_statistics.count_oracle_f1([1], [-1], [0])


# ------------------------------------------------------------------------------------------ gate
def _evaluation(
    f1: float, duplicate_rate: float = 0.0, recall_8: float = 0.8, recall_26: float = 0.75
) -> dict:
    """A dev evaluation with exact counts (no count-oracle headroom) unless a test adds some."""
    return {
        "f1": f1,
        "duplicate_rate": duplicate_rate,
        "gt_count_buckets": {"8-12": {"recall": recall_8}, "26-30": {"recall": recall_26}},
        "per_image": {"tp": [8, 20], "fp": [2, 5], "fn": [2, 5]},
    }


DIFFERS = {"prefix_fn_supervised": 0.6, "keep_all_supervised": 0.3}


def test_gate_needs_f1_in_range_and_any_one_room_clause_and_every_target_differing() -> None:
    assert not rules.gate_verdict(_evaluation(0.6), DIFFERS)["passed"]  # no room at all
    for room in (
        {"duplicate_rate": 0.02},
        {"recall_8": 0.8, "recall_26": 0.7},
    ):
        verdict = rules.gate_verdict(_evaluation(0.6, **room), DIFFERS)
        assert verdict["passed"], room
    headroom = _evaluation(0.6)
    headroom["per_image"] = {"tp": [8, 20], "fp": [0, 0], "fn": [2, 5]}  # stops early: oracle adds 7 TP
    verdict = rules.gate_verdict(headroom, DIFFERS)
    assert verdict["room_for_the_mechanism"]["count_oracle_headroom"]["passed"] and verdict["passed"]
    room = {"duplicate_rate": 0.05}
    assert rules.gate_verdict(_evaluation(0.44, **room), DIFFERS)["f1_side"] == "low"
    assert rules.gate_verdict(_evaluation(0.86, **room), DIFFERS)["f1_side"] == "high"
    assert not rules.gate_verdict(_evaluation(0.6, **room), {**DIFFERS, "keep_all_supervised": 0.24})[
        "passed"
    ]
    assert not rules.gate_verdict(_evaluation(0.6, **room), {})["passed"]
    no_crowded = _evaluation(0.6)
    del no_crowded["gt_count_buckets"]["26-30"]
    assert rules.gate_verdict(no_crowded, DIFFERS)["room_for_the_mechanism"]["recall_drop_8_12_to_26_30"] == {
        "value": None,
        "passed": False,
    }


def test_stage1_is_extended_only_while_f1_is_below_the_range() -> None:
    def gate(f1: float, room: bool = True) -> dict[str, Any]:
        return rules.gate_verdict(_evaluation(f1, duplicate_rate=0.05 if room else 0.0), DIFFERS)

    assert rules.stage1_next(gate(0.6), 3000, 18000) == "pass"
    assert rules.stage1_next(gate(0.3), 3000, 18000) == "extend"
    assert rules.stage1_next(gate(0.3), 18000, 18000) == "fail_budget"
    assert rules.stage1_next(gate(0.9), 3000, 18000) == "fail_high"
    assert rules.stage1_next(gate(0.6, room=False), 3000, 18000) == "fail_room"


# ------------------------------------------------------------------------------------ statistics
def test_paired_t_matches_scipy_and_handles_degenerate_seeds() -> None:
    diffs = [0.01, 0.03, -0.005, 0.02, 0.015]
    result = study_statistics.paired_t(diffs)
    reference = stats.ttest_1samp(diffs, 0.0)
    assert result["t"] == pytest.approx(reference.statistic, abs=1e-3)
    assert result["p"] == pytest.approx(reference.pvalue, abs=1e-4)
    assert result["ci95"][0] < np.mean(diffs) < result["ci95"][1]
    assert study_statistics.paired_t([0.02])["t"] is None
    assert study_statistics.paired_t([0.0, 0.0])["p"] == 1.0


def _per_image(gts: np.ndarray, found: np.ndarray) -> dict[str, list[int]]:
    """Every image finds ``found`` of its ``gts`` objects and lists nothing else."""
    return {"tp": [int(v) for v in found], "fp": [0] * len(gts), "fn": [int(v) for v in gts - found]}


def test_bucket_bootstrap_sees_a_gain_only_on_the_crowded_images() -> None:
    gts = np.array([9, 10, 15, 22, 27, 28, 30] * 20)
    base = _per_image(gts, gts - 3)
    better = _per_image(gts, np.where(gts >= 26, gts - 1, gts - 3))  # two more found on 26-30 only
    rng = np.random.default_rng(0)
    crowded = study_statistics.bucket_bootstrap([better] * 2, [base] * 2, "26-30", 200, rng)
    assert crowded["images"] == 60 and crowded["delta_f1"] > 0 and crowded["ci95"][0] > 0
    sparse = study_statistics.bucket_bootstrap([better] * 2, [base] * 2, "8-12", 200, rng)
    assert sparse["images"] == 40 and sparse["delta_f1"] == 0.0 and sparse["ci95"] == [0.0, 0.0]
    assert study_statistics.bucket_bootstrap([better], [base], "31+", 10, rng) is None
    assert list(study_statistics.images_in_bucket([5, 31, 40, 12], "31+")) == [1, 2]


def _contrast(delta: float, low: float) -> dict[str, Any]:
    return {"delta_f1": delta, "ci95": [low, delta + 0.02]}


def test_gain_verdict_overall_clause_needs_the_interval_above_zero() -> None:
    buckets = dict.fromkeys(rules.CROWD_BUCKETS, _contrast(0.0, -0.01))
    assert rules.gain_verdict(_contrast(0.021, 0.001), buckets, 5)["gain"] is True
    assert rules.gain_verdict(_contrast(0.021, -0.001), buckets, 5)["gain"] is False
    assert rules.gain_verdict(_contrast(0.019, 0.001), buckets, 5)["gain"] is False
    assert rules.gain_verdict(_contrast(0.03, 0.01), buckets, 4)["gain"] is None  # too few seeds
    assert rules.gain_verdict(_contrast(0.03, 0.01), buckets, 4)["overall_gain"] is True


def test_gain_verdict_crowded_clause_needs_a_monotone_rise_across_buckets() -> None:
    overall = _contrast(0.01, -0.002)
    rising = dict(
        zip(rules.CROWD_BUCKETS, [_contrast(d, d - 0.01) for d in (0.0, 0.01, 0.02, 0.045)], strict=True)
    )
    verdict = rules.gain_verdict(overall, rising, 5)
    assert verdict == {
        "overall_gain": False,
        "crowded_gain": True,
        "monotone_across_buckets": True,
        "gain": True,
    }
    dip = {**rising, "20-25": _contrast(-0.01, -0.02)}
    assert rules.gain_verdict(overall, dip, 5)["gain"] is False
    small = {**rising, "26-30": _contrast(0.039, 0.02)}
    assert rules.gain_verdict(overall, small, 5)["gain"] is False
    noisy = {**rising, "26-30": _contrast(0.05, -0.001)}
    assert rules.gain_verdict(overall, noisy, 5)["gain"] is False
    missing = {**rising, "13-19": None}
    assert rules.gain_verdict(overall, missing, 5)["monotone_across_buckets"] is False


def test_equal_compute_uses_each_arms_own_cost_rounded_to_the_checkpoint_grain() -> None:
    costs = {"prefix_fn_supervised": 0.7, "grpo_f1_k4": 2.6, "cheap": 0.1, "huge": 50.0}
    steps = rules.equal_compute_steps_by_arm(costs, 0.2, 1000, 50)
    assert steps == {"prefix_fn_supervised": 3500, "grpo_f1_k4": 13000, "cheap": 1000, "huge": 20000}
    assert rules.seeds_needed([0.01, 0.012]) == 5 and rules.seeds_needed([0.01, 0.0121]) == 8


# -------------------------------------------------------------------------------- resumability
def _args(tmp: Path, **overrides: Any) -> argparse.Namespace:
    argv = ["--out", str(tmp), "--steps", "2", "--eval-at", "2", "--seeds", "0", "1", "2", "3", "4"]
    args = dense_study.parse_args(argv)
    return argparse.Namespace(**{**vars(args), **overrides})


def test_a_unit_file_present_is_not_run_again(tmp_path: Path) -> None:
    unit = {"steps": 2, "evals": {}, "marker": "done before"}
    (tmp_path / "arms" / "sft").mkdir(parents=True)
    (tmp_path / "arms" / "sft" / "seed0.json").write_text(json.dumps(unit))
    # a stage-1 that does not exist: anything but reading the unit would fail
    missing = tmp_path / "no-stage1"
    ran = dense_arms.run_arm(tmp_path, "sft", 0, missing, {}, _args(tmp_path), 2, [2], [2])
    assert ran == unit


def test_stage1_walks_the_chunk_gates_done_and_writes_the_decision(tmp_path: Path) -> None:
    (tmp_path / "stage1").mkdir()
    low = {**rules.gate_verdict(_evaluation(0.3, duplicate_rate=0.05), DIFFERS), "checkpoint": "c1"}
    good = {**rules.gate_verdict(_evaluation(0.6, duplicate_rate=0.05), DIFFERS), "checkpoint": "c2"}
    for trunk, gate in ((3000, low), (6000, good)):
        (tmp_path / "stage1" / f"gate-{trunk}.json").write_text(json.dumps(gate))
    args = _args(tmp_path, stage1_chunk=3000, stage1_max_steps=18000)
    gate = dense_gate.stage1_and_gate(tmp_path, {}, args)
    assert gate["passed"] and gate["checkpoint"] == "c2" and gate["decision"] == "pass"
    assert [h["decision"] for h in gate["history"]] == ["extend", "pass"]
    assert json.loads((tmp_path / "gate.json").read_text()) == gate


def test_a_study_folder_refuses_other_settings(tmp_path: Path) -> None:
    units.lock_settings(tmp_path, _args(tmp_path), CROWD_LOCKED)
    with pytest.raises(SystemExit, match=r"other \['steps'\]"):
        units.lock_settings(tmp_path, _args(tmp_path, steps=3), CROWD_LOCKED)
    units.lock_settings(
        tmp_path, _args(tmp_path, seeds=[0, 1, 2, 3, 4, 5, 6, 7]), CROWD_LOCKED
    )  # seeds may grow


def test_an_arm_this_code_cannot_configure_is_refused_naming_what_it_needs(monkeypatch) -> None:
    arm = {"variant": "rollout_matching_sft", "loss": {"no_such_key": 1.0}, "needs": "loss.no_such_key"}
    monkeypatch.setitem(dense_study.ARMS, "future_arm", arm)
    with pytest.raises(SystemExit, match=r"(?s)arm future_arm needs loss.no_such_key.*no_such_key.*Merge"):
        dense_arms.require_arms(["sft", "future_arm"])
    dense_arms.require_arms(["sft", "prefix_fn_supervised"])


def test_the_gate_reads_which_targets_keep_the_answers_own_elements_and_which_differ(
    tmp_path: Path, coord_model_dir: Path
) -> None:
    from rollmatch.config.load import load_config_dict
    from rollmatch.config.schema import LossConfig
    from rollmatch.data.prompts import PromptEncoder
    from rollmatch.data.records import load_records
    from rollmatch.data.shapes import SHAPES_PRESETS
    from rollmatch.detection.object_formats import build_codec
    from rollmatch.detection.objects import DetObject

    splits = shapes_recipe.generate_splits(tmp_path, {"train": 1, "dev": 2}, SHAPES_PRESETS["crowd"])
    args = _args(tmp_path, backend="hf", max_new_tokens=64)
    cfg = load_config_dict(
        shapes_recipe.base_config(tmp_path, str(coord_model_dir), splits, args, seed=0), []
    )
    dev = load_records(splits["dev"])
    encoder = PromptEncoder.from_pretrained(coord_model_dir, cfg.data, object_format="coord_tokens")
    codec = build_codec("coord_tokens", encoder.tokenizer, [encoder.eos_token_id])
    gts = [encoder.gt_objects(r, encoder.encode(r)) for r in dev]
    false_positive = DetObject(gts[1][0].label, (0, 0, 2, 2))  # nowhere near a 16-32 px object
    answers = [
        codec.serialize(gts[0][:2]),  # SFT's first two objects, in SFT's order, the rest missed
        codec.serialize([false_positive, *gts[1][:2]]),  # a false positive first
    ]
    predictions = tmp_path / "predictions.jsonl"
    predictions.write_text("".join(json.dumps({"text": a, "truncated": False}) + "\n" for a in answers))
    losses = {
        "prefix_fn_supervised": LossConfig(keep_prefix="matched", matched_prefix="supervise"),
        "keep_all_supervised": LossConfig(keep_prefix="all", matched_prefix="supervise"),
    }
    reading = shapes_recipe.target_reading(cfg, coord_model_dir, dev, predictions, losses)
    # the kept prefix of the first answer, rewritten to its GT, is SFT's own start: kept, not different;
    # the second keeps nothing under `matched` (cut at the false positive) and all of it under `all`
    assert reading["prefix_fn_supervised"] == {"keeps_own": 0.5, "differs": 0.0}
    assert reading["keep_all_supervised"] == {"keeps_own": 1.0, "differs": 0.5}


# ------------------------------------------------------------------------------------- summary
def _report(gts: np.ndarray, found: np.ndarray) -> dict[str, Any]:
    per_image = _per_image(gts, found)
    metrics = dict.fromkeys(dense_summary.METRICS, 0.5)
    buckets = {}
    for bucket in rules.CROWD_BUCKETS:
        idx = study_statistics.images_in_bucket(gts, bucket)
        recall = float(found[idx].sum() / gts[idx].sum())
        buckets[bucket] = {
            "images": len(idx),
            "precision": 1.0,
            "recall": recall,
            "f1": 2 * recall / (1 + recall),
        }
    oracle = study_statistics.count_oracle_headroom(per_image)
    return {**metrics, "per_image": per_image, "gt_count_buckets": buckets, "count_oracle": oracle}


def test_summary_applies_the_rule_and_plots_from_unit_files_alone(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    gts = rng.integers(8, 31, size=120)
    for arm, extra in (("sft", 0), ("keep_all_supervised", 2)):
        (tmp_path / "arms" / arm).mkdir(parents=True)
        for seed in range(5):
            # the arm finds `extra` more objects on crowded images, more the more crowded
            found = np.maximum(gts - 5 + np.where(gts >= 20, extra * (1 + (gts >= 26)), 0) + (seed % 2), 0)
            found = np.minimum(found, gts)
            run = {
                "steps": 2,
                "train_seconds": 10.0,
                "train_cpu_seconds": 9.0,
                "evals": {"2": {"dev": _report(gts, found), "report": _report(gts, found)}},
            }
            (tmp_path / "arms" / arm / f"seed{seed}.json").write_text(json.dumps(run))
    args = _args(tmp_path, bootstrap=200, arms=["sft", "keep_all_supervised"])
    settings = units.lock_settings(tmp_path, args, CROWD_LOCKED)
    result = dense_summary.summarize(tmp_path, args, settings, {}, list(dense_study.ARMS), dense_study.PILOT)
    assert result["missing"] == []
    equal_steps = result["comparisons"]["keep_all_supervised"]["equal_steps"]
    assert equal_steps["verdict"]["monotone_across_buckets"] and equal_steps["verdict"]["gain"] is True
    assert (
        equal_steps["by_bucket"]["8-12"]["delta_f1"] == 0.0
        and equal_steps["by_bucket"]["26-30"]["delta_f1"] > 0.04
    )
    assert equal_steps["overall"]["t_test"]["seeds"] == 5
    assert result["default_target_on_dev"]["target"] == "keep_all_supervised"
    assert result["default_target_on_dev"]["chosen_on"] == "dev"
    result["commit"] = "test"
    dense_plot.plot(result, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 10_000


def test_summary_of_a_stage1_in_progress_shows_each_gate_and_plots_before_any_arm(tmp_path: Path) -> None:
    gts = np.random.default_rng(2).integers(8, 31, size=60)
    (tmp_path / "stage1").mkdir()
    for trunk, found in ((3000, gts // 4), (6000, gts // 2)):
        dev = {**_report(gts, found), "f1": trunk / 20000}
        gate = {**rules.gate_verdict(dev, DIFFERS), "trunk_steps": trunk, "dev": dev}
        (tmp_path / "stage1" / f"gate-{trunk}.json").write_text(json.dumps(gate))
    args = _args(tmp_path)
    settings = units.lock_settings(tmp_path, args, CROWD_LOCKED)
    result = dense_summary.summarize(tmp_path, args, settings, {}, list(dense_study.ARMS), dense_study.PILOT)
    progress = result["gate"]["in_progress"]
    assert [(g["trunk_steps"], g["f1"], g["f1_side"]) for g in progress] == [
        (3000, 0.15, "low"),
        (6000, 0.3, "low"),
    ]
    assert (
        progress[1]["dev"]["gt_count_buckets"]["26-30"]["recall"]
        > progress[0]["dev"]["gt_count_buckets"]["26-30"]["recall"]
    )
    assert result["arms"] == {} and dense_plot._stage1_dev(result["gate"])[0] == 6000  # the newest gate
    result["commit"] = "test"
    dense_plot.plot(result, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 10_000


def test_a_stage1_still_low_at_the_budget_stops_the_study_saying_what_that_means(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "dense_study"  # the smoke's --out
    gts = np.random.default_rng(3).integers(8, 31, size=40)
    (out / "stage1").mkdir(parents=True)
    for trunk in (2, 4):
        dev = {**_report(gts, gts // 3), "f1": 0.2}
        gate = {**rules.gate_verdict(dev, DIFFERS), "trunk_steps": trunk, "dev": dev, "commit": "test"}
        (out / "stage1" / f"gate-{trunk}.json").write_text(json.dumps({**gate, "checkpoint": "none"}))
    smoke = [a for a in shlex.split(dense_study.SMOKE_ARGS.format(tmp=tmp_path)) if a != "--ignore-gate"]
    result = dense_study.run_study(dense_study.parse_args([*smoke, "--stage1-max-steps", "4", "--pilot"]))
    assert "the gate decided fail_budget at 4 trunk steps" in capsys.readouterr().err
    assert not (out / "pilot").exists() and result["arms"] == {}  # the checkpoint "none" never loaded
    assert result["gate"]["decision"] == "fail_budget"
    assert [h["decision"] for h in result["gate"]["history"]] == ["extend", "fail_budget"]
    assert result["answer"] == {
        "state": "stopped at the gate",
        "decision": "fail_budget",
        "reading": rules.STOP_READINGS["fail_budget"] + "; no arm was run",
        "arms_outside_protocol": False,
    }
    assert (out / "dense_study.png").stat().st_size > 10_000


def test_the_answer_waits_for_every_arm_seed_before_reading_the_verdicts() -> None:
    assert rules.study_answer(None, {}, 35, False)["state"] == "stage-1 in progress"
    assert rules.study_answer("extend", {}, 35, False)["state"] == "stage-1 in progress"
    # arms trained after a stop (--ignore-gate, as the smoke run does) are said to be outside the protocol
    anyway = rules.study_answer("fail_budget", {}, 0, True)
    assert anyway["state"] == "stopped at the gate" and anyway["arms_outside_protocol"]
    assert anyway["reading"].endswith("arms were run anyway (--ignore-gate), outside the protocol")
    assert rules.study_answer("pass", {"keep_all_supervised": None}, 4, True) == {
        "state": "arms running",
        "missing_arm_seeds": 4,
    }
    done = rules.study_answer("pass", {"keep_all_supervised": True, "grpo": False}, 0, True)
    assert done["gains"] == ["keep_all_supervised"] and "keep_all_supervised" in done["reading"]
    assert (
        rules.study_answer("pass", {"grpo": False}, 0, True)["reading"]
        == "no arm gains over sft by the decision rule"
    )
    assert (
        rules.study_answer("pass", {"grpo": None}, 0, True)["gains"] is None
    )  # fewer than 5 seeds: no verdict


def test_pilot_summary_measures_cost_and_spread_and_says_how_many_seeds(tmp_path: Path) -> None:
    gts = np.random.default_rng(1).integers(8, 31, size=300)
    for arm, found in (("sft", gts - 6), ("prefix_fn_supervised", gts - 5), ("keep_all_supervised", gts - 4)):
        (tmp_path / "pilot" / "arms" / arm).mkdir(parents=True)
        run = {
            "steps": 500,
            "train_seconds": 1000.0,
            "train_cpu_seconds": 1500.0 if arm != "sft" else 500.0,
            "evals": {"250": {"dev": _report(gts, found)}, "500": {"dev": _report(gts, found)}},
        }
        (tmp_path / "pilot" / "arms" / arm / "seed0.json").write_text(json.dumps(run))
    args = _args(tmp_path, bootstrap=200, dev_size=300, report_size=600)
    pilot = dense_summary.pilot_summary(tmp_path, args, dense_study.PILOT)
    assert pilot["arms"]["keep_all_supervised/seed0"]["cpu_seconds_per_step"] == 3.0
    assert pilot["arms"]["sft/seed0"]["dev_f1"] == {"250": 0.5, "500": 0.5}
    spreads = pilot["spread_at_report_size"]
    assert set(spreads) == {"prefix_fn_supervised/seed0", "keep_all_supervised/seed0"}
    # every image gains the same: the paired difference barely moves under image resampling
    assert all(0 <= s < rules.SPREAD_LIMIT for s in spreads.values()) and pilot["seeds_needed"] == rules.SEEDS


# ------------------------------------------------------------------------------ end to end, heavy
@pytest.mark.bench
@pytest.mark.timeout(1500)  # three runs; the first takes ~4 min on a loaded 2-core machine
def test_the_driver_runs_end_to_end_at_its_smallest_setting_and_resumes(tmp_path: Path) -> None:
    """SMOKE_ARGS (sft only, a few images and steps): the JSON, the unit files, a rerun that trains
    nothing, and --summarize."""
    command = [
        sys.executable,
        "-m",
        "studies.dense_study",
        *shlex.split(dense_study.SMOKE_ARGS.format(tmp=tmp_path)),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def run(*extra: str) -> dict[str, Any]:
        done = subprocess.run(
            [*command, *extra], cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env
        )
        assert done.returncode == 0, done.stderr[-4000:]
        return json.loads(done.stdout)

    first = run()
    assert set(dense_study.SMOKE_KEYS) <= set(first)
    study = tmp_path / "dense_study"
    unit = study / "arms" / "sft" / "seed0.json"
    assert first["gate"]["decision"] == "fail_budget" and first["arms"]["sft"]["seeds"] == [0]
    assert json.loads(unit.read_text())["commit"] == first["commit"]
    assert json.loads(unit.read_text())["evals"]["2"]["report"]["decoding"]["temperature"] == 0.0
    assert (study / "dense_study.png").exists()
    stamps = {
        p: p.stat().st_mtime_ns
        for p in study.rglob("*.json")
        if p.name not in ("dense_study.json", "settings.json")
    }
    again = run()
    assert again["arms"] == first["arms"]
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # no unit recomputed
    assert run("--summarize")["arms"] == first["arms"]
