"""Two real gloo ranks (forked from the test process, tests/fork_ranks.py: this is about our
lock-step logic, not torchrun; the launcher's and the learner's tests run real torchrun): every rank
runs the kind rank 0 decided, on every micro-step, with exactly one forward/backward per micro-step
(DDP lock-step).

Fault injection: rank 1 is given a different ``b_ratio`` than rank 0, so a rank that decided its
own kind would run B where rank 0 runs A. Each rank logs the kind it executed per micro-step, and a
forward hook logs every training forward (grad enabled: rollouts run without grad).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
from fork_ranks import run_forked_ranks

from rollmatch.config.load import config_to_yaml


def rank_probe(cfg_path: Path, log_dir: Path, rank: int) -> None:
    """One rank's training run, with the fault injected and every training forward logged."""
    import torch
    import transformers

    from rollmatch.config.load import load_config
    from rollmatch.training.entry import run_training

    cfg = load_config(cfg_path)
    if rank == 1:
        cfg.stage2_ab.schedule.b_ratio = 1.0  # disagrees with rank 0; rank 0's broadcast must win
    handler = logging.FileHandler(log_dir / f"kinds-rank{rank}.log")
    stage2_log = logging.getLogger("rollmatch.training.trainer")
    stage2_log.setLevel(logging.DEBUG)
    stage2_log.addHandler(handler)
    auto = transformers.AutoModelForImageTextToText
    load_model = auto.from_pretrained

    def counting_forwards(*args: Any, **kwargs: Any) -> Any:
        model = load_model(*args, **kwargs)

        def count(module: Any, inputs: Any) -> None:
            if torch.is_grad_enabled():
                stage2_log.debug("training forward on rank %d", rank)

        model.register_forward_pre_hook(count)
        return model

    auto.from_pretrained = counting_forwards  # this rank's own copy of the process: not the test's
    run_training(cfg)


EXECUTED = re.compile(r"stage2_ab step (\d+) micro-step (\d+)/(\d+) ran Channel-([AB]) on rank (\d+)")
FORWARD = "training forward on rank"


def forwards_per_micro_step(lines: str) -> list[int]:
    """Training forwards logged before each micro-step's line (its passes run before it is logged)."""
    counts, forwards = [], 0
    for line in lines.splitlines():
        if FORWARD in line:
            forwards += 1
        elif EXECUTED.search(line):
            counts.append(forwards)
            forwards = 0
    return counts


@pytest.mark.heavy
def test_every_rank_runs_rank_zeros_kind_for_the_whole_window(make_config, tmp_path):
    cfg = make_config(
        {
            "custom": {
                "trainer_variant": "stage2_ab_training",
                "extra": {"rollout_matching": {"max_new_tokens": 8}},
            },
            "stage2_ab": {"schedule": {"b_ratio": 0.5}},  # rank 0: A, B
            "preflight": {"records": 0},  # rollout training from an untrained model: no format check
            "training": {
                "per_device_train_batch_size": 1,
                "gradient_accumulation_steps": 2,
                "max_steps": 2,
                "logging_steps": 1,
            },
        }
    )
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(config_to_yaml(cfg))
    run_forked_ranks(lambda rank: rank_probe(cfg_path, tmp_path, rank), timeout_s=280)

    expected = [(0, 1, 2, "A"), (0, 2, 2, "A"), (1, 1, 2, "B"), (1, 2, 2, "B")]
    for rank in (0, 1):
        lines = (tmp_path / f"kinds-rank{rank}.log").read_text()
        executed = [m.groups() for m in EXECUTED.finditer(lines)]
        assert [(int(s), int(i), int(n), k) for s, i, n, k, _ in executed] == expected, (rank, lines)
        assert {int(r) for *_, r in executed} == {rank}
        # One record per micro-step fits one packed row twice over: without padding rows the first
        # micro-step of each step would run no pass and the second two.
        assert forwards_per_micro_step(lines) == [1, 1, 1, 1], (rank, lines)

    logs = [
        json.loads(line)
        for line in (Path(cfg.training.output_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [h for h in logs if "loss" in h]
    assert [h["stage2_ab/step_kind_b"] for h in steps] == [0.0, 1.0]
    assert steps[0]["stage2_ab/micro_steps_a"] == 4  # 2 micro-steps x 2 ranks
    assert steps[1]["stage2_ab/micro_steps_b"] == 4
    assert steps[1]["stage2_ab/rollouts"] == 4
    assert steps[1]["stage2_ab/loss_b"] == pytest.approx(steps[1]["loss"], rel=1e-4)
    # rollout log (default on): step 1 (Channel-A) passed it on to step 2, whose rank-0 rollouts it logged
    rollouts = Path(cfg.training.output_dir) / "rollouts"
    assert sorted(p.name for p in rollouts.glob("*.jsonl")) == ["step-2.jsonl"]
    assert len((rollouts / "step-2.jsonl").read_text().splitlines()) == 2  # rank 0's 2 records of the step
