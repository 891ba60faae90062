"""The dense-scene studies' decision rules (pure: per-image counts and eval JSONs in, verdicts out).

Owns what ``studies/dense_study.py`` decides with, fixed before any arm runs (docs/runbook.md,
"Crowded scenes" and "Medium scenes"; each preset's thresholds are its ``study_protocols.StudyProtocol``):

- :func:`gate_verdict` (F1 range, room for the mechanism, targets differing from SFT's, and for the
  medium study the GRPO clause, :func:`grpo_clause`) and
  :func:`stage1_next` (pass, extend stage-1, or stop) with what a stop means (:data:`STOP_READINGS`,
  :func:`study_answer`);
- :func:`gain_verdict` (the crowd decision rule, with its monotone-bucket clause), :func:`medium_verdict` (the medium rule:
  gain, harm, or the largest effect the data allow);
- :func:`equal_compute_steps_by_arm` (SFT steps matching each arm's own cost) and
  :func:`seeds_needed` (5 or 8 seeds from the pilot's spread).

Leaves out: the statistics the rules read (``studies/study_statistics.py``: paired bootstrap, paired
t-test, count-oracle F1), training, evaluation and files (``studies/dense_study.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from studies.study_protocols import CROWD, GrpoGate, StudyProtocol
from studies.study_statistics import count_oracle_headroom

# ----------------------------------------------------------------------- fixed before any arm runs
# the crowd study's gate (studies/study_protocols.py holds every study's: CROWD, the medium rungs)
F1_GATE = CROWD.f1_gate  # label-aware dev F1@0.5 of the stage-1 checkpoint
HEADROOM_GATE = CROWD.headroom_gate  # count-oracle headroom on dev
DUPLICATE_GATE = CROWD.duplicate_gate  # dev duplicate rate
RECALL_DROP_GATE = CROWD.recall_drop_gate  # recall at 8-12 minus recall at 26-30 on dev
DIFFERS_GATE = CROWD.differs_gate  # each rollout target differs from SFT's in token ids on this share
SPARSE_BUCKET, CROWDED_BUCKET = CROWD.sparse_bucket, CROWD.crowded_bucket
CROWD_BUCKETS = CROWD.buckets  # eval.count_buckets' default edges, 8-30 objects
OVERALL_GAIN = 0.02  # overall F1@0.5 gain over sft, with the 95% interval above 0
CROWDED_GAIN = 0.04  # or this in the 26-30 bucket, interval above 0, rising monotonely across buckets
MIN_SEEDS = 5  # no verdict on fewer
POSITIVE_SEEDS_SHARE, MAP_SLACK = 0.8, 0.01  # the medium rule: 4 of 5 seeds positive, mAP at most 0.01 lower
SEEDS, MORE_SEEDS, SPREAD_LIMIT = 5, 8, 0.012  # 8 seeds if the pilot's spread exceeds the limit
MAX_COMPUTE_RATIO = 20  # SFT at equal compute trains at most this many times the arms' steps


# ------------------------------------------------------------------------------------------- gate
def gate_verdict(
    evaluation: Mapping[str, Any],
    differs: Mapping[str, float],
    protocol: StudyProtocol = CROWD,
    grpo: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The gate on one stage-1 checkpoint's dev evaluation (``learning_signal.evaluate``'s dict) and the
    share of dev records whose target differs from SFT's in token ids, per rollout target, by the
    thresholds of ``protocol``. A protocol with a GRPO clause also needs ``grpo``: the dev reading of K
    sampled rollouts per record (``zero_std_group_frac``, ``malformed_frac``); without it that clause
    fails, naming what is missing."""
    f1 = float(evaluation["f1"])
    sparse_name, crowded_name = protocol.sparse_bucket, protocol.crowded_bucket
    buckets = evaluation.get("gt_count_buckets", {})
    sparse, crowded = buckets.get(sparse_name), buckets.get(crowded_name)
    drop = None if not (sparse and crowded) else round(sparse["recall"] - crowded["recall"], 4)
    headroom = count_oracle_headroom(evaluation["per_image"])["headroom"]
    drop_key = f"recall_drop_{sparse_name}_to_{crowded_name}".replace("-", "_")
    room = {
        "count_oracle_headroom": {"value": headroom, "passed": headroom >= protocol.headroom_gate},
        "duplicate_rate": {
            "value": round(float(evaluation["duplicate_rate"]), 4),
            "passed": float(evaluation["duplicate_rate"]) >= protocol.duplicate_gate,
        },
        drop_key: {"value": drop, "passed": drop is not None and drop >= protocol.recall_drop_gate},
    }
    low, high = protocol.f1_gate
    f1_in_range = low <= f1 <= high
    room_passed = any(clause["passed"] for clause in room.values())
    differs_passed = bool(differs) and all(share >= protocol.differs_gate for share in differs.values())
    result = {
        "passed": bool(f1_in_range and room_passed and differs_passed),
        "f1": round(f1, 4),
        "f1_in_range": f1_in_range,
        "f1_side": "low" if f1 < low else "high" if f1 > high else "in range",
        "room_for_the_mechanism": {"passed": room_passed, **room},
        "targets_differing_from_sft": {"passed": differs_passed, **dict(differs)},
        "rule": (
            f"dev label-aware F1@0.5 in {list(protocol.f1_gate)}; room for the mechanism (count-oracle "
            f"headroom >= {protocol.headroom_gate}, or duplicate rate >= {protocol.duplicate_gate}, or recall "
            f"at {crowded_name} at least {protocol.recall_drop_gate} below recall at {sparse_name}); every "
            f"rollout target differs from SFT's in token ids on >= {protocol.differs_gate} of dev records"
        ),
    }
    if protocol.grpo_gate is not None:
        result["grpo_sampling"] = grpo_clause(grpo, protocol.grpo_gate)
        result["passed"] = bool(result["passed"] and result["grpo_sampling"]["passed"])
        gate = protocol.grpo_gate
        result["rule"] += (
            f"; GRPO at K = {gate.rollouts_per_record}, temperature {gate.temperature}: <= "
            f"{gate.max_zero_std_groups} of dev groups with zero reward spread and <= {gate.max_malformed} "
            "of rollouts malformed"
        )
    return result


def grpo_clause(reading: Mapping[str, float] | None, gate: GrpoGate) -> dict[str, Any]:
    """The GRPO clause on a dev reading of sampled groups (None: not measured, so not passed)."""
    if reading is None:
        return {"passed": False, "why": "not measured (the gate needs the dev reading of sampled groups)"}
    zero_std, malformed = float(reading["zero_std_group_frac"]), float(reading["malformed_frac"])
    return {
        "passed": zero_std <= gate.max_zero_std_groups and malformed <= gate.max_malformed,
        "zero_std_group_frac": round(zero_std, 4),
        "malformed_frac": round(malformed, 4),
        "rollouts_per_record": gate.rollouts_per_record,
        "temperature": gate.temperature,
    }


def stage1_next(gate: Mapping[str, Any], trunk_steps: int, max_trunk_steps: int) -> str:
    """After a gate at ``trunk_steps``: ``pass``; ``extend`` (F1 below the range and steps left);
    else why the study stops: ``fail_high`` (F1 above the range: more training cannot bring it back),
    ``fail_room`` (F1 in range but no room for the mechanism or too few differing targets: more
    training only shrinks them), ``fail_budget`` (F1 still low at ``max_trunk_steps``)."""
    if gate["passed"]:
        return "pass"
    if gate["f1_side"] == "high":
        return "fail_high"
    if gate["f1_side"] == "in range":
        return "fail_room"
    return "extend" if trunk_steps < max_trunk_steps else "fail_budget"


# What a stop at the gate means (docs/runbook.md, "Crowded scenes"): no arm runs. ``fail_budget`` first
# read "the mechanism is absent"; a stop on stage-1's F1 measures the detector, not the mechanism, so
# it now says that (the decision and every figure are unchanged).
STOP_READINGS = {
    "fail_budget": (
        "no stage-1 reached the gate's F1 range within the step budget: detector quality, not the "
        "mechanism (the study cannot ask its question of this stage-1)"
    ),
    "fail_room": (
        "stage-1 reached the F1 range without room for the mechanism or with too few rollout targets "
        "differing from SFT's: the mechanism is absent in this model class on this data"
    ),
    "fail_high": ("stage-1 overshot the F1 range: too little left for any target to improve on this data"),
}


# The medium study's readings of a stop (docs/runbook.md, "Medium scenes"): they say which clause
# failed and what that measures, and the ladder (study_protocols.next_rung) may go on to another rung.
MEDIUM_STOP_READINGS = {
    "fail_budget": (
        "no stage-1 reached the gate's F1 range within the step budget: detector quality, not a "
        "measurement of the mechanism (the question cannot be asked of this stage-1 on this rung)"
    ),
    "fail_room": (
        "stage-1 reached the F1 range but a clause other than F1 failed (failed_clauses): on this rung "
        "the arms would have too little of their own mistakes to train on, or GRPO too little signal"
    ),
    "fail_high": "stage-1 overshot the F1 range: too few errors left on this rung for any arm to fix",
}


def study_answer(
    decision: str | None,
    verdicts: Mapping[str, bool | None],
    missing: int,
    arms_run: bool,
    readings: Mapping[str, str] = STOP_READINGS,
    baseline: str = "sft",
) -> dict[str, Any]:
    """The study's answer so far: stage-1 in progress, stopped at the gate (:data:`STOP_READINGS`; with
    ``arms_run``, arms trained anyway under ``--ignore-gate``, outside the protocol), arms running, or
    each arm's :func:`gain_verdict` once every arm-seed is in (``missing == 0``)."""
    if decision is None or decision == "extend":
        return {"state": "stage-1 in progress", "reading": "no answer yet: the gate has not decided"}
    if decision in readings:
        after = "arms were run anyway (--ignore-gate), outside the protocol" if arms_run else "no arm was run"
        return {
            "state": "stopped at the gate",
            "decision": decision,
            "reading": f"{readings[decision]}; {after}",
            "arms_outside_protocol": arms_run,
        }
    if missing or not verdicts:
        return {"state": "arms running", "missing_arm_seeds": missing}
    if any(gain is None for gain in verdicts.values()):
        return {"state": "done", "gains": None, "reading": f"no verdict: fewer than {MIN_SEEDS} seeds"}
    gains = sorted(arm for arm, gain in verdicts.items() if gain)
    reading = (
        f"a gain over {baseline} by the decision rule: {', '.join(gains)}"
        if gains
        else f"no arm gains over {baseline} by the decision rule"
    )
    return {"state": "done", "gains": gains, "reading": reading}


def gain_verdict(
    overall: Mapping[str, Any], buckets: Mapping[str, Mapping[str, Any] | None], seeds: int
) -> dict[str, Any]:
    """The decision rule: a gain is ``+OVERALL_GAIN`` overall with the 95% interval above 0, or
    ``+CROWDED_GAIN`` in the 26-30 bucket with its interval above 0 and the bucket differences rising
    monotonely (each >= the previous) from 8-12 to 26-30. ``gain`` is None on fewer than MIN_SEEDS seeds."""
    overall_gain = overall["delta_f1"] >= OVERALL_GAIN and overall["ci95"][0] > 0
    ordered = [buckets.get(b) for b in CROWD_BUCKETS]
    monotone = all(b is not None for b in ordered) and all(
        later["delta_f1"] >= earlier["delta_f1"]  # type: ignore[index]
        for earlier, later in itertools.pairwise(ordered)
    )
    crowded = buckets.get(CROWDED_BUCKET)
    crowded_gain = bool(
        crowded is not None and crowded["delta_f1"] >= CROWDED_GAIN and crowded["ci95"][0] > 0 and monotone
    )
    return {
        "overall_gain": bool(overall_gain),
        "crowded_gain": crowded_gain,
        "monotone_across_buckets": monotone,
        "gain": bool(overall_gain or crowded_gain) if seeds >= MIN_SEEDS else None,
    }


def medium_verdict(
    overall: Mapping[str, Any], delta_map: float, delta_truncated: float, seeds: int
) -> dict[str, Any]:
    """The medium study's rule on an arm minus ``sft_equal_compute`` (report F1@0.5, paired bootstrap over
    seeds x images with its ``per_seed`` differences): **gain** = +``OVERALL_GAIN`` or more with the 95%
    interval above 0, at least ``POSITIVE_SEEDS_SHARE`` of the seeds positive (4 of 5), mAP not lower by
    more than ``MAP_SLACK`` and truncation not higher; **harm** = the interval below 0; otherwise the
    interval's upper bound is the largest effect the data allow. ``gain`` is None on fewer than
    MIN_SEEDS seeds."""
    per_seed = list(overall["per_seed"])
    positive = sum(d > 0 for d in per_seed)
    low, high = overall["ci95"]
    gain = bool(
        overall["delta_f1"] >= OVERALL_GAIN
        and low > 0
        and positive >= POSITIVE_SEEDS_SHARE * len(per_seed)
        and delta_map >= -MAP_SLACK
        and delta_truncated <= 0
    )
    harm = bool(high < 0)
    enough = seeds >= MIN_SEEDS
    return {
        "gain": gain if enough else None,
        "harm": harm if enough else None,
        "positive_seeds": f"{positive} of {len(per_seed)}",
        "delta_map": round(delta_map, 4),
        "delta_truncated": round(delta_truncated, 4),
        "largest_effect_allowed": None if gain or harm else round(float(high), 4),
    }


def equal_compute_steps_by_arm(
    cost_per_step: Mapping[str, float], sft_cost_per_step: float, steps: int, grain: int
) -> dict[str, int]:
    """SFT steps costing what ``steps`` steps of each arm cost (each arm's own cost per step), rounded
    to a multiple of ``grain`` (the equal-compute run's checkpoint spacing), at least ``steps`` and at
    most ``MAX_COMPUTE_RATIO * steps``."""
    if sft_cost_per_step <= 0:
        raise ValueError(f"sft cost per step must be > 0, got {sft_cost_per_step}")
    out = {}
    for arm, cost in cost_per_step.items():
        raw = steps * cost / sft_cost_per_step
        rounded = max(grain, round(raw / grain) * grain)
        out[arm] = int(min(max(steps, rounded), MAX_COMPUTE_RATIO * steps))
    return out


def choose_learning_rates(dev_f1: Mapping[str, Mapping[float, float]]) -> dict[str, float]:
    """Per arm, the learning rate of the pilot with the higher dev F1 (the lower rate on a tie)."""
    return {arm: max(sorted(by_lr), key=lambda lr: (by_lr[lr], -lr)) for arm, by_lr in dev_f1.items()}


def seeds_needed(spreads: Sequence[float]) -> int:
    """SEEDS, or MORE_SEEDS when any pilot arm's spread of the paired difference exceeds SPREAD_LIMIT."""
    return MORE_SEEDS if any(s > SPREAD_LIMIT for s in spreads) else SEEDS


def stop_readings(protocol: StudyProtocol) -> Mapping[str, str]:
    """What a stop at the gate means in ``protocol``'s study (the crowd study's readings were fixed with it)."""
    return STOP_READINGS if protocol is CROWD else MEDIUM_STOP_READINGS
