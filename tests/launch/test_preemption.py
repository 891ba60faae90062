"""The scheduler's warning signal on a real ``rollmatch launch --cpu`` (one hf server, a 2-rank learner):
SIGUSR1 mid-run makes the learner save a complete checkpoint and stop (exit 5, no final model), with
every process of the launch receiving it as Slurm may deliver it; the requeued launch resumes from that
checkpoint and finishes: rerun with the same config and no resume override (a resubmitted Slurm script
is that: ``training.resume_from_checkpoint: auto``, the default, finds the newest complete checkpoint). Stepwise (micro) and async Channel-B alike."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rollmatch.launch.heartbeat import EXIT_PREEMPTED
from rollmatch.launch.processes import survivors

RUN_TIMEOUT_S = 420


@pytest.mark.heavy
@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("channel_b_mode", ["micro", "async"])
def test_the_warning_signal_checkpoints_mid_run_and_the_requeued_launch_resumes(
    channel_b_mode: str, launch_config: Callable[..., Path], start_launch: Callable[..., Any]
) -> None:
    config = launch_config(
        training={"max_steps": 10_000},
        stage2_ab={"schedule": {"b_ratio": 0.5}, "channel_b": {"mode": channel_b_mode}},
    )
    run = start_launch(config, "--cpu", "--learner-procs", "2", "--engine", "hf", "--grace-s", "5")
    out = run.launch_dir.parent
    metrics = out / "metrics.jsonl"
    run.wait_for(lambda: metrics.exists() and "loss" in metrics.read_text(), 300, "a trained step")

    # Slurm may signal every process of the step: none but the learner's ranks may act on it
    pids = run.pids()
    everyone = [p["pid"] for entry in pids["processes"] for p in [entry, *entry["descendants"]]]
    for pid in [run.process.pid, *everyone]:
        os.kill(pid, signal.SIGUSR1)
    code = run.wait(RUN_TIMEOUT_S)
    output = run.output()
    assert code == EXIT_PREEMPTED, output[-6000:]
    assert "received SIGUSR1 (the scheduler's warning): forwarded to the learner" in output
    assert "learner stopped on the warning signal" in output.splitlines()[-1]
    stopped = [
        int(s) for s in re.findall(r"stopped on the warning signal \(SIGUSR1\) after step (\d+)", output)
    ]
    assert len(stopped) == 2 and len(set(stopped)) == 1, output[-6000:]  # both ranks, at the same step
    step = stopped[0]
    checkpoint = out / f"checkpoint-{step}"
    marker = json.loads((checkpoint / "rollmatch_complete.json").read_text())
    assert marker["world_size"] == 2 and (checkpoint / "rollmatch_state_rank1.pt").is_file()
    assert not (out / "final").exists()  # stopped, not finished
    assert survivors(run.pids()) == []

    # the resubmitted job: the same launch, no resume override; it goes on from the checkpoint
    requeued = start_launch(
        config,
        f"training.max_steps={step + 1}",
        "--cpu",
        "--learner-procs",
        "2",
        "--engine",
        "hf",
    )
    code = requeued.wait(RUN_TIMEOUT_S)
    output = requeued.output()
    assert code == 0, output[-6000:]
    assert output.count(f"trained {step + 1} steps") == 2, output[-6000:]
    logged = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [h["step"] for h in logged if "loss" in h and "step" in h]
    assert steps[-1] == step + 1 and steps.count(step + 1) == 1, steps  # one step after the checkpoint
    assert steps.count(1) == 1, steps  # resumed: step 1 was not trained again
    assert (out / "final" / "config.json").is_file()
    assert survivors(requeued.pids()) == []
