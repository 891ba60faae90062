"""The scheduler's warning signal during an async ``max_wait_s`` wait, end to end: a real ``rollmatch train``
learner (async Channel-B, server mode; one process forked from the test's, ``fork_ranks.py``) against a
real HF ``rollmatch serve`` on 127.0.0.1 whose engine steps are held by a gate file the test controls
(``gated_server.py``), so no rollout can finish and the learner's first B step sits in its ``max_wait_s``
wait (an hour: far beyond this test's own bounds).

SIGUSR1 then ends the wait within one wait slice: the step trains what is ready (Channel-A, the queue being
empty), a complete checkpoint is saved and the learner exits; the rerun with the same config (no resume
override: ``training.resume_from_checkpoint: auto``) resumes from that checkpoint with the gate open and
trains on.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from fork_ranks import ForkedRanks, train_in_forked_ranks
from test_async_learner import async_config, make_shapes, step_metrics

pytestmark = pytest.mark.heavy
MAX_WAIT_S = 3600.0  # the wait only the signal can end within this test's bounds
RUN_TIMEOUT_S = 420.0
STOP_TIMEOUT_S = 240.0  # signal -> exit with a checkpoint; a fifteenth of MAX_WAIT_S


def start_learner(config: dict[str, Any], tmp_path: Path, name: str) -> tuple[ForkedRanks, Path]:
    """``rollmatch train`` on ``config`` in one process forked from this one (``fork_ranks.py``: no
    second interpreter importing torch), its output in the returned log file."""
    config_path = tmp_path / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    learner = train_in_forked_ranks(config_path, tmp_path / f"logs-{name}", world_size=0)
    return learner, tmp_path / f"logs-{name}" / "0" / "output.log"


def calls_at_the_server(url: str) -> int:
    report = requests.get(f"{url}/health/", timeout=10).json()
    return int(report["queued_calls"] + report["running_calls"])


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + STOP_TIMEOUT_S + 120)
def test_the_warning_signal_during_a_max_wait_s_wait_checkpoints_and_the_rerun_resumes(
    start_server: Callable[..., Any], tiny_model_dir: Path, tmp_path: Path, free_port: Callable[[], int]
) -> None:
    # the gate holds the engine for the whole wait: its stall watch must not call that a stall
    server = start_server(
        tiny_model_dir, "--engine", "hf", "--engine-stall-timeout-s", str(int(MAX_WAIT_S)), gated=True
    )
    gate: Path = server.step_gate
    out = tmp_path / "out"
    config = async_config(
        tiny_model_dir,
        make_shapes(tmp_path),
        out,
        server.url,
        free_port(),
        max_steps=50,
        max_wait_s=MAX_WAIT_S,
    )
    config["training"]["collective_timeout_s"] = 1.2 * MAX_WAIT_S  # a wait this long must fit the step's vote
    # The gate still holds the actor's call when the learner stops: it waits this long for the actor, then
    # exits leaving it (the default, 10 s, would be this test's longest idle gap).
    config["stage2_ab"]["channel_b"]["async"]["actor_stop_timeout_s"] = 1.0
    gate.touch()  # no engine step runs: the actor's rollouts stay in flight, no pack is ever ready
    learner, log_path = start_learner(config, tmp_path, "first")
    try:
        # The actor starts right after the run's first push, inside step 0: once its calls reach the
        # server, the learner is in (or entering) step 0's wait for packs, which nothing but the signal ends.
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while calls_at_the_server(server.url) == 0:
            assert learner.running(), log_path.read_text(errors="replace")[-6000:]
            assert time.monotonic() < deadline, "the actor's calls never reached the server"
            time.sleep(0.2)
        assert not (out / "metrics.jsonl").exists() or "loss" not in (out / "metrics.jsonl").read_text()
        learner.send_signal(signal.SIGUSR1)
        signalled = time.monotonic()
        code = learner.wait(STOP_TIMEOUT_S, check=False)[0]
        stopped_after_s = time.monotonic() - signalled
    finally:
        learner.kill()
        gate.unlink(missing_ok=True)
    output = log_path.read_text(errors="replace")
    assert code == 0, output[-6000:]
    assert "stopped waiting for Channel-B packs after" in output, output[-6000:]
    assert "stopped on the warning signal (SIGUSR1) after step 1: checkpoint-1 saved" in output, output[
        -6000:
    ]
    assert stopped_after_s < MAX_WAIT_S / 10, stopped_after_s
    marker = json.loads((out / "checkpoint-1" / "rollmatch_complete.json").read_text())
    assert marker["world_size"] == 1
    assert not (out / "final").exists()  # stopped, not finished
    first = step_metrics(out)
    assert [h["step"] for h in first] == [1] and first[0]["stage2_ab/step_kind_b"] == 0.0, first

    # The rerun (a requeued or resubmitted job): same config, the gate open; it resumes from checkpoint-1.
    config["training"]["max_steps"] = 3
    config["custom"]["extra"]["rollout_matching"]["vllm"]["server"]["servers"][0]["group_port"] = free_port()
    rerun, rerun_log = start_learner(config, tmp_path, "rerun")
    try:
        code = rerun.wait(RUN_TIMEOUT_S, check=False)[0]
    finally:
        rerun.kill()
    output = rerun_log.read_text(errors="replace")
    assert code == 0, output[-6000:]
    assert "trained 3 steps" in output, output[-6000:]
    steps = [h["step"] for h in step_metrics(out)]
    assert steps == [1, 2, 3], steps  # step 1 not trained again: resumed from checkpoint-1
    assert (out / "final" / "config.json").is_file()
