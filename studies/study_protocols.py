"""The pre-registered protocols of the dense-scene studies, one per shapes preset (rung), fixed before
any unit runs (docs/runbook.md, "Crowded scenes" and "Medium scenes").

Owns: :data:`ARMS` (each arm's trainer variant, loss, rollouts and what the code must support),
:class:`StudyProtocol` (what a study on one preset decides with: the data sizes and streams, the
stage-1 budget, the GT-count buckets, the gate's thresholds and clauses, the arms and their learning
rates, the seeds) and :data:`PROTOCOLS` (``crowd``, the study that stopped at its gate, and the medium
study's three rungs ``medium``, ``medium_dense``, ``medium_sparse``), with the ladder between rungs
(:func:`next_rung`: a gate that is too easy goes to the denser rung, ``fail_budget`` to the sparser
one, each rung its own output folder, and the ladder is walked once).

Leaves out: the rules and statistics (``studies/study_rules.py``, ``studies/study_statistics.py``), running
units (``studies/dense_study.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_RM = "rollout_matching_sft"
_KEEP_ALL = {"target": "prefix_fn", "keep_prefix": "all", "matched_prefix": "supervise"}
_NEEDS_TARGETS = "loss.keep_prefix: all with loss.matched_prefix: supervise (training after own mistakes)"
_SAMPLED_K4 = {"decoding": {"temperature": 0.7}, "rollouts_per_record": 4}
FP_UNLIKELIHOOD_WEIGHT = 0.5
# The arms every study draws from: name -> trainer variant, loss.*, custom.extra.rollout_matching.*, and what the code must support
ARMS: dict[str, dict[str, Any]] = {
    "sft": {"variant": "sft", "loss": {}},
    "prefix_fn_supervised": {
        "variant": _RM,
        "loss": {"target": "prefix_fn", "keep_prefix": "matched", "matched_prefix": "supervise"},
    },
    "keep_all_supervised": {"variant": _RM, "loss": _KEEP_ALL, "needs": _NEEDS_TARGETS},
    "keep_all_supervised_fp_unlikelihood": {
        "variant": _RM,
        "loss": {**_KEEP_ALL, "fp_unlikelihood_weight": FP_UNLIKELIHOOD_WEIGHT},
        "needs": f"{_NEEDS_TARGETS} and loss.fp_unlikelihood_weight",
    },
    "keep_all_supervised_sampled_k4": {
        "variant": _RM,
        "loss": _KEEP_ALL,
        "rollout": _SAMPLED_K4,
        "needs": f"{_NEEDS_TARGETS} and custom.extra.rollout_matching.rollouts_per_record",
    },
    # On-policy: the colocated trainer samples a step's K rollouts per record with that step's weights and
    # takes one optimizer step on them (no gradient accumulation in these studies).
    "grpo_f1_k4": {
        "variant": _RM,
        "loss": {"objective": "grpo", "grpo": {"reward": "f1"}},
        "rollout": _SAMPLED_K4,
        "needs": "loss.objective: grpo, loss.grpo.reward: f1 and "
        "custom.extra.rollout_matching.rollouts_per_record",
    },
    # The medium study's noise-object SFT control (Pix2Seq sequence augmentation): the SFT target padded to
    # the preset's largest object count (dense_study.arm_config sets loss.noise_objects.pad_to) with noise
    # objects labelled "noise" whose coordinate tokens are unsupervised; evaluation drops them before scoring.
    "sft_noise_objects": {
        "variant": "sft",
        "loss": {"noise_objects": {"enabled": True, "label": "noise"}},
        "needs": "loss.noise_objects (noise objects after the real ones in the SFT target, their coordinate "
        "tokens unsupervised) and evaluation dropping the `noise` label",
    },
}
TARGET_ARMS = ("prefix_fn_supervised", "keep_all_supervised")  # the gate's rollout targets

# The settings a crowd study folder is locked to (its settings.json has these keys, and only these).
CROWD_LOCKED = (
    "train_size",
    "dev_size",
    "report_size",
    "object_format",
    "max_new_tokens",
    "stage1_lr",
    "stage1_chunk",
    "stage1_max_steps",
    "stage1_seed",
    "lr",
    "steps",
    "eval_at",
    "gate_targets",
)
# A medium rung also records its preset and the arm pool (stage-1 never sees it).
MEDIUM_LOCKED = ("preset", *CROWD_LOCKED[:1], "arm_pool_size", *CROWD_LOCKED[1:])


@dataclass(frozen=True)
class GrpoGate:
    """The GRPO clause: at K rollouts per dev record and the arm's temperature, the share of groups whose
    K rewards are all equal (no advantage, no gradient) and the share of malformed rollouts."""

    rollouts_per_record: int = 4
    temperature: float = 0.7
    max_zero_std_groups: float = 0.50
    max_malformed: float = 0.20


@dataclass(frozen=True)
class StudyProtocol:
    """Everything one study on one shapes preset fixes before its first unit runs."""

    preset: str  # rollmatch.data.shapes.SHAPES_PRESETS name: the data of this rung
    title: str  # the plot's
    buckets: tuple[str, ...]  # GT-count buckets reported and plotted (eval JSON gt_count_buckets keys)
    count_buckets: tuple[int, ...] | None  # eval.count_buckets lower edges (None: the config default)
    f1_gate: tuple[float, float]
    headroom_gate: float
    duplicate_gate: float
    recall_drop_gate: float  # recall(first bucket) - recall(last bucket) at least this
    differs_gate: float  # each gate target differs from SFT's in token ids on this share of dev
    grpo_gate: GrpoGate | None
    defaults: dict[str, Any]  # the driver's argument defaults for this rung
    locked: tuple[str, ...]  # the settings a study folder is locked to
    arms: tuple[str, ...]  # the arms a full run trains (sft_equal_compute follows from them)
    gate_targets: tuple[str, ...]
    primary_baseline: str  # what the primary rule compares each arm with
    docs_name: str  # --docs copies the study's JSON and PNG to docs/<docs_name>.json / .png
    lr_pair: tuple[float, ...] = ()  # the pilot picks each arm's learning rate from these (empty: --lr)
    pilot_steps: int = 0  # the learning-rate pilot's steps per arm and rate (dev, seed 0)
    ladder: dict[str, str] = field(default_factory=dict)  # gate decision -> next rung's preset

    @property
    def sparse_bucket(self) -> str:
        return self.buckets[0]

    @property
    def crowded_bucket(self) -> str:
        return self.buckets[-1]


CROWD = StudyProtocol(
    preset="crowd",
    title="crowded scenes",
    buckets=("8-12", "13-19", "20-25", "26-30"),  # eval.count_buckets' default edges, 8-30 objects
    count_buckets=None,
    f1_gate=(0.45, 0.85),
    headroom_gate=0.04,
    duplicate_gate=0.02,
    recall_drop_gate=0.10,
    differs_gate=0.25,
    grpo_gate=None,
    defaults={
        "train_size": 4000,
        "arm_pool_size": 0,
        "dev_size": 300,
        "report_size": 600,
        "max_new_tokens": 1024,
        "stage1_chunk": 3000,
        "stage1_max_steps": 18000,
        "lr": 2e-4,
        "steps": 1000,
        "eval_at": [500, 1000],
    },
    locked=CROWD_LOCKED,
    arms=(
        "sft",
        "prefix_fn_supervised",
        "keep_all_supervised",
        "keep_all_supervised_fp_unlikelihood",
        "keep_all_supervised_sampled_k4",
        "grpo_f1_k4",
    ),
    gate_targets=("prefix_fn_supervised", "keep_all_supervised"),
    primary_baseline="sft",
    docs_name="dense_study",
)


def _medium(
    preset: str, buckets: tuple[str, ...], edges: tuple[int, ...], max_new_tokens: int, **ladder: str
):
    """A rung of the medium study: the same rules, sizes and arms; its own objects, buckets and budget
    of new tokens (a medium object is about 25 tokens with coordinate tokens)."""
    return StudyProtocol(
        preset=preset,
        title=f"medium scenes ({preset})",
        buckets=buckets,
        count_buckets=edges,
        f1_gate=(0.50, 0.85),
        headroom_gate=0.03,
        duplicate_gate=0.02,
        recall_drop_gate=0.08,
        differs_gate=0.25,
        grpo_gate=GrpoGate(),
        defaults={
            # stage-1 pool: 8,000 trunk steps x 8 records = 4 epochs of 16,000 images
            "train_size": 16000,
            "arm_pool_size": 4800,  # 600 steps x 8 records: one epoch per arm and seed
            "dev_size": 300,
            "report_size": 1000,
            "max_new_tokens": max_new_tokens,
            "stage1_chunk": 2000,
            "stage1_max_steps": 8000,
            "lr": 1e-4,
            "steps": 600,
            "eval_at": [300, 600],
        },
        locked=MEDIUM_LOCKED,
        arms=("sft", "keep_all_supervised", "grpo_f1_k4", "sft_noise_objects"),
        gate_targets=("keep_all_supervised",),
        primary_baseline="sft_equal_compute",
        docs_name="medium_study",  # every rung: the ladder is one study
        lr_pair=(1e-4, 3e-4),
        pilot_steps=300,
        ladder=dict(ladder),
    )


PROTOCOLS: dict[str, StudyProtocol] = {
    "crowd": CROWD,
    # 4-12 objects of 32-56 px: 12 objects are ~300 tokens, 512 leave room for ~8 more (duplicates)
    "medium": _medium(
        "medium",
        ("4-6", "7-9", "10-12"),
        (4, 7, 10, 13),
        512,
        too_easy="medium_dense",
        fail_budget="medium_sparse",
    ),
    # 7-18 objects of 32-48 px: 18 objects are ~450 tokens
    "medium_dense": _medium("medium_dense", ("7-9", "10-12", "13-15", "16-18"), (7, 10, 13, 16, 19), 768),
    # 3-8 objects of 40-64 px
    "medium_sparse": _medium("medium_sparse", ("3-4", "5-6", "7-8"), (3, 5, 7, 9), 512),
}


def next_rung(protocol: StudyProtocol, gate: dict[str, Any]) -> str | None:
    """The rung the ladder goes to after this rung's decided gate, or None (pass, or no rung that way).

    Too easy (``fail_high``, or ``fail_room`` whose only failing clause is the room for the mechanism)
    goes to the denser rung; ``fail_budget`` to the sparser one. A gate failing on its other clauses
    (targets differing from SFT's, the GRPO clause) stops the study: a denser scene does not fix them.
    Only the first rung has moves, so the ladder never goes back to a rung it left."""
    decision = gate["decision"]
    if decision == "fail_high" or (
        decision == "fail_room" and failed_clauses(gate) == ["room_for_the_mechanism"]
    ):
        return protocol.ladder.get("too_easy")
    if decision == "fail_budget":
        return protocol.ladder.get("fail_budget")
    return None


def failed_clauses(gate: dict[str, Any]) -> list[str]:
    """The gate's clauses that failed, in the rule's order (``f1_in_range`` first)."""
    failed = [] if gate.get("f1_in_range") else ["f1_in_range"]
    for clause in ("room_for_the_mechanism", "targets_differing_from_sft", "grpo_sampling"):
        if clause in gate and not gate[clause]["passed"]:
            failed.append(clause)
    return failed
