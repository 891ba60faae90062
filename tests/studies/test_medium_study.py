"""The medium-scenes study (studies/study_protocols.py and the preset-driven studies/dense_study.py): its
preset and rungs, its gate clauses (GRPO sampling included), the ladder, its decision rule against
``sft_equal_compute``, the noise-object control (SFT padded to the preset's largest count), its pools,
and (heavy) one end-to-end gate at absurdly small sizes that walks the ladder."""

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

from rollmatch.data.records import load_records
from rollmatch.data.shapes import SHAPES_PRESETS, shape_sample
from rollmatch.detection.count_metrics import count_bucket_label
from studies import dense_arms, dense_gate, dense_plot, dense_study, dense_summary, study_statistics, units
from studies import study_rules as rules
from studies.study_protocols import PROTOCOLS, failed_clauses, next_rung

REPO = Path(__file__).resolve().parents[2]

MEDIUM = PROTOCOLS["medium"]


# ------------------------------------------------------------------------------ preset and rungs
@pytest.mark.parametrize("rung", ["medium", "medium_dense", "medium_sparse"])
def test_each_rung_draws_its_objects_and_its_buckets_cover_its_counts(rung: str) -> None:
    difficulty, protocol = SHAPES_PRESETS[rung], PROTOCOLS[rung]
    counts = []
    for index in range(40):
        _, objects = shape_sample(index, split="val", seed=1, difficulty=difficulty)
        counts.append(len(objects))
        for obj in objects:  # a shape's box is its visible extent: at most its side, a little less
            x1, y1, x2, y2 = obj.bbox
            assert max(x2 - x1, y2 - y1) <= difficulty.max_side, (rung, obj)
    assert difficulty.min_objects <= min(counts) and max(counts) <= difficulty.max_objects
    # every count the preset can draw falls in one of the protocol's buckets, named as evaluation names it
    labels = {
        count_bucket_label(n, protocol.count_buckets)
        for n in range(difficulty.min_objects, difficulty.max_objects + 1)
    }
    assert labels == set(protocol.buckets), rung


def test_medium_is_four_to_twelve_objects_of_one_visual_token_or_more() -> None:
    medium = SHAPES_PRESETS["medium"]
    assert (medium.min_objects, medium.max_objects, medium.min_side, medium.max_side) == (4, 12, 32, 56)
    assert MEDIUM.buckets == ("4-6", "7-9", "10-12")
    assert SHAPES_PRESETS["crowd"].max_side == 32 and PROTOCOLS["crowd"].buckets == rules.CROWD_BUCKETS


# ------------------------------------------------------------------------------------------ gate
def _dev(f1: float, recall_small: float = 0.8, recall_large: float = 0.8, duplicates: float = 0.0) -> dict:
    """A medium dev evaluation with exact counts (no count-oracle headroom) unless a test adds some."""
    return {
        "f1": f1,
        "duplicate_rate": duplicates,
        "gt_count_buckets": {"4-6": {"recall": recall_small}, "10-12": {"recall": recall_large}},
        "per_image": {"tp": [4, 9], "fp": [1, 2], "fn": [1, 2]},
    }


GOOD_GRPO = {"zero_std_group_frac": 0.5, "malformed_frac": 0.2}
DIFFERS = {"keep_all_supervised": 0.25}


def test_medium_gate_thresholds_are_its_own() -> None:
    room = {"recall_small": 0.8, "recall_large": 0.72}  # a drop of exactly 0.08
    passed = rules.gate_verdict(_dev(0.50, **room), DIFFERS, MEDIUM, GOOD_GRPO)
    assert passed["passed"], passed
    assert passed["room_for_the_mechanism"]["recall_drop_4_6_to_10_12"] == {"value": 0.08, "passed": True}
    assert rules.gate_verdict(_dev(0.49, **room), DIFFERS, MEDIUM, GOOD_GRPO)["f1_side"] == "low"
    assert rules.gate_verdict(_dev(0.86, **room), DIFFERS, MEDIUM, GOOD_GRPO)["f1_side"] == "high"
    # 0.07 is not enough here; the crowd gate would not even see these buckets
    assert not rules.gate_verdict(_dev(0.6, 0.8, 0.73), DIFFERS, MEDIUM, GOOD_GRPO)["passed"]
    assert rules.gate_verdict(_dev(0.6, duplicates=0.02), DIFFERS, MEDIUM, GOOD_GRPO)["passed"]
    headroom = _dev(0.6)
    headroom["per_image"] = {"tp": [30, 0], "fp": [0, 0], "fn": [1, 0]}  # one missed object: oracle adds it
    verdict = rules.gate_verdict(headroom, DIFFERS, MEDIUM, GOOD_GRPO)
    assert verdict["room_for_the_mechanism"]["count_oracle_headroom"] == {"value": 0.0164, "passed": False}
    headroom["per_image"] = {"tp": [15, 0], "fp": [0, 0], "fn": [1, 0]}
    assert rules.gate_verdict(headroom, DIFFERS, MEDIUM, GOOD_GRPO)["passed"]  # headroom 0.0323 >= 0.03
    assert not rules.gate_verdict(
        _dev(0.6, duplicates=0.05), {"keep_all_supervised": 0.24}, MEDIUM, GOOD_GRPO
    )["passed"]


def test_the_grpo_clause_bounds_zero_spread_groups_and_malformed_rollouts() -> None:
    dev = _dev(0.6, duplicates=0.05)
    for reading, passed in (
        (GOOD_GRPO, True),
        ({"zero_std_group_frac": 0.51, "malformed_frac": 0.0}, False),
        ({"zero_std_group_frac": 0.0, "malformed_frac": 0.21}, False),
    ):
        verdict = rules.gate_verdict(dev, DIFFERS, MEDIUM, reading)
        assert verdict["grpo_sampling"]["passed"] is passed and verdict["passed"] is passed, reading
    unmeasured = rules.gate_verdict(dev, DIFFERS, MEDIUM, None)
    assert not unmeasured["passed"] and "not measured" in unmeasured["grpo_sampling"]["why"]
    assert "temperature 0.7" in unmeasured["rule"] and "K = 4" in unmeasured["rule"]
    assert "grpo_sampling" not in rules.gate_verdict(
        dev, {"prefix_fn_supervised": 1.0}
    )  # the crowd gate has none


# ---------------------------------------------------------------------------------------- ladder
def _decided(dev: dict, differs: dict, grpo: dict, trunk: int, budget: int = 8000) -> dict[str, Any]:
    gate = rules.gate_verdict(dev, differs, MEDIUM, grpo)
    return {**gate, "decision": rules.stage1_next(gate, trunk, budget)}


def test_the_ladder_goes_denser_when_too_easy_sparser_on_the_budget_and_stops_otherwise() -> None:
    high = _decided(_dev(0.9, duplicates=0.05), DIFFERS, GOOD_GRPO, 2000)
    assert high["decision"] == "fail_high" and next_rung(MEDIUM, high) == "medium_dense"
    no_room = _decided(_dev(0.6), DIFFERS, GOOD_GRPO, 2000)
    assert (
        failed_clauses(no_room) == ["room_for_the_mechanism"] and next_rung(MEDIUM, no_room) == "medium_dense"
    )
    no_signal = _decided(_dev(0.6), DIFFERS, {"zero_std_group_frac": 0.9, "malformed_frac": 0.0}, 2000)
    assert no_signal["decision"] == "fail_room"
    assert failed_clauses(no_signal) == ["room_for_the_mechanism", "grpo_sampling"]
    assert next_rung(MEDIUM, no_signal) is None  # a denser scene does not fix GRPO's signal
    low = _decided(_dev(0.3, duplicates=0.05), DIFFERS, GOOD_GRPO, 8000)
    assert low["decision"] == "fail_budget" and next_rung(MEDIUM, low) == "medium_sparse"
    assert _decided(_dev(0.3), DIFFERS, GOOD_GRPO, 6000)["decision"] == "extend"
    for rung in ("medium_dense", "medium_sparse"):  # the ladder never goes back to a rung it left
        assert next_rung(PROTOCOLS[rung], high) is None and next_rung(PROTOCOLS[rung], low) is None


def test_the_next_rung_runs_the_same_command_in_its_own_folder() -> None:
    argv = ["--preset", "medium", "--out", "/r/medium", "--only-gate", "--follow-ladder", "--train-size=8"]
    assert dense_study.ladder_argv(argv, "medium_sparse", "/r/medium_sparse") == [
        "--out",
        "/r/medium_sparse",
        "--preset",
        "medium_sparse",
        "--only-gate",
        "--follow-ladder",
        "--train-size=8",
    ]


def test_a_decided_gate_names_the_next_rung_beside_the_study_folder(tmp_path: Path) -> None:
    out = tmp_path / "medium"
    (out / "stage1").mkdir(parents=True)
    for trunk in (2000, 4000):
        low = {
            **rules.gate_verdict(_dev(0.3, duplicates=0.05), DIFFERS, MEDIUM, GOOD_GRPO),
            "checkpoint": "c",
        }
        (out / "stage1" / f"gate-{trunk}.json").write_text(json.dumps(low))
    args = _args(out, stage1_chunk=2000, stage1_max_steps=4000)
    gate = dense_gate.stage1_and_gate(out, {}, args)
    assert gate["decision"] == "fail_budget"
    assert gate["next_rung"] == {"preset": "medium_sparse", "out": str(tmp_path / "medium_sparse")}


# ----------------------------------------------------------------------------- settings and pools
def _args(out: Path, **overrides: Any) -> argparse.Namespace:
    args = dense_study.parse_args(["--preset", "medium", "--out", str(out)])
    return argparse.Namespace(**{**vars(args), **overrides})


def test_the_preset_sets_the_studys_defaults_and_a_flag_still_wins(tmp_path: Path) -> None:
    medium = dense_study.parse_args(["--preset", "medium", "--out", str(tmp_path)])
    assert (medium.train_size, medium.arm_pool_size, medium.dev_size, medium.report_size) == (
        16000,
        4800,
        300,
        1000,
    )
    assert (medium.stage1_chunk, medium.stage1_max_steps, medium.steps, medium.max_new_tokens) == (
        2000,
        8000,
        600,
        512,
    )
    assert medium.arms == ["sft", "keep_all_supervised", "grpo_f1_k4", "sft_noise_objects"]
    assert medium.gate_targets == ["keep_all_supervised"]
    assert medium.train_size * 4 >= medium.stage1_max_steps * 8  # <= 4 epochs at batch 8
    crowd = dense_study.parse_args(["--out", str(tmp_path)])  # the crowd study's command lines are unchanged
    assert (crowd.preset, crowd.train_size, crowd.arm_pool_size, crowd.report_size) == ("crowd", 4000, 0, 600)
    assert (crowd.stage1_chunk, crowd.stage1_max_steps, crowd.lr, crowd.steps) == (3000, 18000, 2e-4, 1000)
    assert crowd.arms == list(PROTOCOLS["crowd"].arms) and crowd.max_new_tokens == 1024
    dense = dense_study.parse_args(
        ["--preset", "medium_dense", "--out", str(tmp_path), "--stage1-chunk", "5"]
    )
    assert dense.max_new_tokens == 768 and dense.stage1_chunk == 5


def test_a_medium_folder_is_locked_to_its_preset_and_pools(tmp_path: Path) -> None:
    settings = units.lock_settings(tmp_path, _args(tmp_path), MEDIUM.locked)
    assert settings["preset"] == "medium" and settings["arm_pool_size"] == 4800
    with pytest.raises(SystemExit, match=r"other \['arm_pool_size', 'preset'\]"):
        units.lock_settings(tmp_path, _args(tmp_path, preset="medium_dense", arm_pool_size=8), MEDIUM.locked)


def test_the_arms_train_on_their_own_pool_stage1_never_sees(tmp_path: Path) -> None:
    args = _args(tmp_path, train_size=3, arm_pool_size=3, dev_size=2, report_size=2)
    splits = dense_arms.prepare_data(tmp_path, args)
    assert set(splits) == {"train", "dev", "report", "arms"}
    pixels = {
        split: [Path(r.images[0]).read_bytes() for r in load_records(path)] for split, path in splits.items()
    }
    everything = [image for images in pixels.values() for image in images]
    assert len(set(everything)) == len(everything)  # each pool its own stream: no image twice
    model = tmp_path / "model"
    arm = dense_arms.arm_config(tmp_path / "arm", "sft", 0, model, splits, args, 2)
    stage1 = dense_arms.sft_config(tmp_path / "trunk", model, splits, args)
    assert arm.data.train_jsonl == str(splits["arms"]) and stage1.data.train_jsonl == str(splits["train"])
    assert arm.eval.count_buckets == stage1.eval.count_buckets == [4, 7, 10, 13]


def test_the_noise_object_control_is_sft_padded_to_the_presets_largest_count(tmp_path: Path) -> None:
    dense_arms.require_arms(list(MEDIUM.arms))  # the protocol's arms, the noise control among them
    assert "sft_noise_objects" in MEDIUM.arms
    splits = {"train": tmp_path / "train.jsonl", "arms": tmp_path / "arms.jsonl"}
    for preset in ("medium", "medium_dense", "crowd"):
        args = _args(tmp_path, preset=preset)
        cfg = dense_arms.arm_config(tmp_path / preset, "sft_noise_objects", 0, tmp_path, splits, args, 2)
        noise = cfg.loss.noise_objects
        assert cfg.custom.trainer_variant == "sft" and noise.enabled and noise.label == "noise"
        assert noise.pad_to == SHAPES_PRESETS[preset].max_objects
        sft = dense_arms.arm_config(tmp_path / preset, "sft", 0, tmp_path, splits, args, 2)
        # the control differs from the sft arm in its target alone: same records, schedule, evaluation
        assert sft.loss.model_copy(update={"noise_objects": noise}) == cfg.loss
        assert sft.training == cfg.training.model_copy(update={"output_dir": sft.training.output_dir})
        assert sft.eval == cfg.eval and not sft.loss.noise_objects.enabled


# ------------------------------------------------------------------------------------------ rule
def _overall(per_seed: list[float], low: float, high: float) -> dict[str, Any]:
    return {"delta_f1": round(float(np.mean(per_seed)), 4), "ci95": [low, high], "per_seed": per_seed}


def test_the_medium_rule_gain_harm_or_the_largest_effect_allowed() -> None:
    gain = _overall([0.03, 0.02, 0.04, 0.02, -0.001], 0.005, 0.04)  # mean 0.0218, 4 of 5 positive
    assert rules.medium_verdict(gain, 0.0, 0.0, 5)["gain"] is True
    assert rules.medium_verdict(gain, -0.011, 0.0, 5)["gain"] is False  # mAP more than 0.01 lower
    assert rules.medium_verdict(gain, -0.01, 0.0, 5)["gain"] is True
    assert rules.medium_verdict(gain, 0.0, 0.001, 5)["gain"] is False  # truncation higher
    three_of_five = _overall([0.05, 0.04, 0.04, -0.001, -0.001], 0.005, 0.05)
    assert rules.medium_verdict(three_of_five, 0.0, 0.0, 5)["positive_seeds"] == "3 of 5"
    assert rules.medium_verdict(three_of_five, 0.0, 0.0, 5)["gain"] is False
    small = _overall([0.01, 0.01, 0.02, 0.01, 0.01], 0.004, 0.019)
    none = rules.medium_verdict(small, 0.0, 0.0, 5)
    assert none["gain"] is False and none["harm"] is False and none["largest_effect_allowed"] == 0.019
    harm = rules.medium_verdict(_overall([-0.02] * 5, -0.03, -0.01), 0.0, 0.0, 5)
    assert harm["harm"] is True and harm["largest_effect_allowed"] is None
    assert rules.medium_verdict(gain, 0.0, 0.0, 4)["gain"] is None  # no verdict on fewer than 5 seeds


def _report(gts: np.ndarray, found: np.ndarray) -> dict[str, Any]:
    per_image = {"tp": [int(v) for v in found], "fp": [0] * len(gts), "fn": [int(v) for v in gts - found]}
    buckets = {}
    for bucket in MEDIUM.buckets:
        idx = study_statistics.images_in_bucket(gts, bucket)
        recall = float(found[idx].sum() / gts[idx].sum())
        buckets[bucket] = {
            "images": len(idx),
            "precision": 1.0,
            "recall": recall,
            "f1": 2 * recall / (1 + recall),
        }
    metrics = {
        **dict.fromkeys(dense_summary.METRICS, 0.5),
        "f1": study_statistics.f1_of(*(np.array(per_image[k]) for k in ("tp", "fp", "fn"))),
    }
    return {
        **metrics,
        "per_image": per_image,
        "gt_count_buckets": buckets,
        "count_oracle": study_statistics.count_oracle_headroom(per_image),
    }


def test_the_medium_summary_judges_each_arm_against_sft_at_equal_compute(tmp_path: Path) -> None:
    gts = np.random.default_rng(0).integers(4, 13, size=90)
    args = _args(
        tmp_path,
        steps=2,
        eval_at=[2],
        seeds=[0, 1, 2, 3, 4],
        arms=["sft", "keep_all_supervised"],
        bootstrap=200,
    )
    equal_compute = tmp_path / "arms" / "sft_equal_compute"
    for arm, extra in (("sft", 0), ("keep_all_supervised", 1)):
        (tmp_path / "arms" / arm).mkdir(parents=True)
        for seed in range(5):
            # the arm finds one more object on the 10-12 images than SFT and than SFT at equal compute
            found = np.minimum(gts - 2 + np.where(gts >= 10, extra, 0), gts)
            report = _report(gts, found)
            run = {
                "steps": 2,
                "train_seconds": 10.0,
                "train_cpu_seconds": 9.0,
                "evals": {"2": {"dev": report, "report": report}},
            }
            (tmp_path / "arms" / arm / f"seed{seed}.json").write_text(json.dumps(run))
    equal_compute.mkdir(parents=True)
    (equal_compute / "steps-keep_all_supervised.json").write_text(json.dumps({"steps": 4}))
    for seed in range(5):
        (equal_compute / f"seed{seed}").mkdir()
        base = _report(gts, np.minimum(gts - 2, gts))
        (equal_compute / f"seed{seed}" / "eval-4-report.json").write_text(json.dumps(base))
    dev = _report(gts, np.minimum(gts - 2, gts))
    gate = {
        "passed": True,
        "f1": 0.6,
        "trunk_steps": 2000,
        "decision": "pass",
        "history": [],
        "dev": dev,
        "commit": "t",
    }
    (tmp_path / "gate.json").write_text(json.dumps(gate))
    settings = units.lock_settings(tmp_path, args, MEDIUM.locked)
    result = dense_summary.summarize(tmp_path, args, settings, {}, list(dense_study.ARMS), dense_study.PILOT)
    compared = result["comparisons"]["keep_all_supervised"]["equal_compute"]
    assert set(compared["by_bucket"]) == set(MEDIUM.buckets)
    assert compared["by_bucket"]["4-6"]["delta_f1"] == 0.0 and compared["by_bucket"]["10-12"]["delta_f1"] > 0
    assert compared["verdict"]["positive_seeds"] == "5 of 5" and compared["verdict"]["gain"] is True
    level = result["sft_equal_compute"]["keep_all_supervised"]  # the baseline's own curve, for the plot
    assert level["sft_steps"] == 4 and level["seeds"] == [0, 1, 2, 3, 4]
    assert (
        level["report_by_bucket"]["10-12"]["recall"]
        < result["arms"]["keep_all_supervised"]["report_by_bucket"]["10-12"]["recall"]
    )
    assert result["answer"] == {
        "state": "done",
        "gains": ["keep_all_supervised"],
        "reading": "a gain over sft_equal_compute by the decision rule: keep_all_supervised",
    }
    result["commit"] = "test"
    dense_plot.plot(result, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 10_000


# ------------------------------------------------------------------------------------ end to end
@pytest.mark.heavy
def test_a_medium_gate_at_its_smallest_setting_records_every_clause_and_walks_the_ladder(
    tmp_path: Path,
) -> None:
    out = tmp_path / "medium"
    command = [
        sys.executable,
        "-m",
        "studies.dense_study",
        "--preset",
        "medium",
        "--out",
        str(out),
        *shlex.split(
            "--train-size 8 --arm-pool-size 8 --dev-size 4 --report-size 4 --stage1-chunk 2 --stage1-max-steps 2 "
            "--steps 2 --eval-at 2 --max-new-tokens 16 --backend hf --bootstrap 10 --only-gate --follow-ladder"
        ),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    printed = json.loads(done.stdout)  # the last rung's JSON
    assert printed["settings"]["preset"] == "medium_sparse" and "medium_sparse" in done.stderr
    gate = json.loads((out / "gate.json").read_text())  # a 2-step stage-1 is far below the range
    assert gate["decision"] == "fail_budget" and gate["next_rung"]["preset"] == "medium_sparse"
    sampling = gate["grpo_sampling"]
    assert sampling["rollouts_per_record"] == 4 and sampling["temperature"] == 0.7
    assert 0 <= sampling["zero_std_group_frac"] <= 1 and 0 <= sampling["malformed_frac"] <= 1
    assert gate["preset"] == "medium" and gate["commit"] and gate["eval_decoding"]["temperature"] == 0.0
    assert set(gate["dev"]["gt_count_buckets"]) <= {"0-3", *MEDIUM.buckets}
    assert json.loads((tmp_path / "medium_sparse" / "gate.json").read_text()).get("next_rung") is None
    assert units.cached(out / "gate.json", lambda: pytest.fail("a decided gate is not run again")) == gate
    # the same command again (how the study resumes) runs no unit: every unit file stays as it was
    unit_files = sorted(tmp_path.rglob("*.json"))
    stamps = {
        p: p.stat().st_mtime_ns for p in unit_files if p.name not in ("dense_study.json", "settings.json")
    }
    again = subprocess.run(command, capture_output=True, text=True, timeout=1200, env=env)
    assert again.returncode == 0, again.stderr[-4000:]
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert (out / "stage1" / "gate-2.grpo_sampling.json") in stamps


# ----------------------------------------------------------------------------------------- pilot
def _run(report: dict[str, Any], steps: int, cpu_seconds: float) -> dict[str, Any]:
    return {
        "steps": steps,
        "train_seconds": cpu_seconds * 1.1,
        "train_cpu_seconds": cpu_seconds,
        "evals": {str(steps): {"dev": report}},
    }


def test_the_pilot_picks_each_arms_learning_rate_on_dev_and_measures_the_spread(tmp_path: Path) -> None:
    gts = np.random.default_rng(1).integers(4, 13, size=60)
    args = _args(tmp_path, arms=["sft", "keep_all_supervised"], bootstrap=200)
    steps = MEDIUM.pilot_steps
    # sft is better at the low rate, keep_all_supervised at the high one (twice sft's cost per step)
    found = {("sft", 1e-4): gts - 2, ("sft", 3e-4): gts - 3, ("keep_all_supervised", 1e-4): gts - 3}
    found[("keep_all_supervised", 3e-4)] = np.where(np.arange(len(gts)) % 2 == 0, gts - 1, gts - 2)
    for (arm, lr), hits in found.items():
        folder = tmp_path / "pilot" / f"lr{lr:g}" / "arms" / arm
        folder.mkdir(parents=True, exist_ok=True)
        cost = 100.0 * (2 if arm != "sft" else 1) * steps / 100
        (folder / "seed0.json").write_text(json.dumps(_run(_report(gts, hits), steps, cost)))
    # SFT at equal compute (twice the steps), done before: nothing trains in this test
    equal = tmp_path / "pilot" / "arms" / "sft_equal_compute"
    (equal / "seed0" / f"at-{2 * steps}").mkdir(parents=True)
    (equal / "seed0" / f"at-{2 * steps}" / "config.json").write_text("{}")
    (equal / "steps-keep_all_supervised.json").write_text(json.dumps({"steps": 2 * steps}))
    base = _report(gts, gts - 2)
    (equal / "seed0" / f"eval-{2 * steps}-dev.json").write_text(json.dumps(base))
    with pytest.raises(SystemExit, match=r"no learning rate chosen by the pilot.*--pilot"):
        dense_study.learning_rates(tmp_path, args)
    dense_study.run_lr_pilot(tmp_path, tmp_path / "no-stage1", {"train": Path("x")}, args)
    assert json.loads((tmp_path / "pilot" / "lr_chosen.json").read_text()) == {
        "sft": 1e-4,
        "keep_all_supervised": 3e-4,
    }
    rates = dense_study.learning_rates(tmp_path, args)
    assert rates["sft"].lr == 1e-4 and rates["keep_all_supervised"].lr == 3e-4 and args.lr == 1e-4
    summary = dense_summary.lr_pilot_summary(tmp_path, args, MEDIUM)
    assert summary["lr_chosen"] == {"sft": 1e-4, "keep_all_supervised": 3e-4}
    assert summary["arms"]["keep_all_supervised/lr0.0003/seed0"]["cpu_seconds_per_step"] == 2.0
    spread = summary["spread_at_report_size"]["keep_all_supervised/seed0"]
    assert 0 < spread < 0.05 and summary["seeds_needed"] in (rules.SEEDS, rules.MORE_SEEDS)
    assert rules.choose_learning_rates({"a": {1e-4: 0.5, 3e-4: 0.5}}) == {"a": 1e-4}  # a tie keeps the lower
