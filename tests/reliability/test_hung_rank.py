"""A 2-rank torchrun (gloo) job where rank 1 hangs inside a step: the whole job exits non-zero in time.

Rank 0 hits the collective timeout (the gradient all-reduce of the next step), logs the fatal error
and leaves with a hard exit at most ``FATAL_EXIT_GRACE_S`` later; torchrun then stops rank 1. Before
the fix the default group ignored ``collective_timeout_s`` (30-minute waits) and a timed-out rank
could hang in process-group teardown.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from rollmatch.collectives import FATAL_EXIT_GRACE_S
from rollmatch.launch.plan import torchrun_command

pytestmark = [pytest.mark.heavy, pytest.mark.integration]  # torchrun jobs, from helpers
REPO = Path(__file__).resolve().parents[2]
COLLECTIVE_TIMEOUT_S = 10
START_UP_S = 120  # two ranks loading torch, transformers and the model on a loaded 2-core machine


def run_two_ranks(
    tmp_path: Path,
    model_dir: Path,
    port: int,
    *,
    script: str,
    env: dict[str, str],
    collective_timeout_s: float,
    budget_s: float,
    sections: dict[str, Any],
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Train 6 steps on 2 ranks under ``script`` (a fault-injecting stand-in for ``rollmatch.cli``);
    the finished process and its wall-clock seconds."""
    from rollmatch.data.shapes import generate_shapes

    data = generate_shapes(tmp_path / "shapes", n_train=8, n_val=1, size=112, seed=0)
    config = {
        "model": {"path": str(model_dir)},
        "data": {"train_jsonl": str(data["train"]), "val_jsonl": None},
        "preflight": {"records": 0},  # rollout training from an untrained model: no format check
        "training": {
            "output_dir": str(tmp_path / "out"),
            "per_device_train_batch_size": 1,
            "max_steps": 6,
            "report_to": [],
            "save_steps": 1000,
            "packing": True,
            "global_max_length": 1024,
            "collective_timeout_s": collective_timeout_s,
        },
        **sections,
    }
    config_path = tmp_path / "faulty.yaml"
    config_path.write_text(yaml.safe_dump(config))
    command = torchrun_command(2, port, str(REPO / "tests/reliability" / script), "train", str(config_path))
    started = time.monotonic()
    run = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=budget_s,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **env),
    )
    return run, time.monotonic() - started


def test_a_hung_rank_takes_the_whole_job_down_within_timeout_plus_grace(
    tiny_model_dir: Path, tmp_path: Path, free_port: Callable[[], int]
) -> None:
    run, elapsed = run_two_ranks(
        tmp_path,
        tiny_model_dir,
        free_port(),
        script="hang_one_rank.py",
        env={"ROLLMATCH_TEST_HANG_AFTER": "3"},
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
        budget_s=START_UP_S + COLLECTIVE_TIMEOUT_S + FATAL_EXIT_GRACE_S + 30,
        sections={"custom": {"trainer_variant": "sft"}},
    )
    output = run.stdout + run.stderr
    assert "rank 1: hanging in forward call 3" in output, output[-4000:]
    assert run.returncode != 0, output[-4000:]
    # gloo words the collective timeout either way (the second seen on a loaded machine)
    timed_out = "Timed out" in output or "Application timeout caused pair closure" in output
    assert "rank 0: fatal distributed error" in output and timed_out, output[-4000:]
    hang_to_exit = output.split("rank 1: hanging")[1]
    assert "exitcode" in hang_to_exit
    print(
        f"hung-rank job exited with {run.returncode} after {elapsed:.0f}s (timeout {COLLECTIVE_TIMEOUT_S}s)"
    )


def test_a_rank_that_fails_alone_takes_every_rank_down_naming_it_long_before_the_timeout(
    tiny_model_dir: Path, tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """Rank 1 raises while building its step's rows; it still joins the step's gather with its error,
    so rank 0 raises there too, naming rank 1's error, instead of waiting out the collective timeout."""
    timeout_s = 600  # the default: a rank left waiting would take ten minutes to notice
    budget = START_UP_S + 60
    run, elapsed = run_two_ranks(
        tmp_path,
        tiny_model_dir,
        free_port(),
        script="fail_one_rank.py",
        env={"ROLLMATCH_TEST_FAIL_AFTER": "3"},
        collective_timeout_s=timeout_s,
        budget_s=budget,
        sections={
            "custom": {
                "trainer_variant": "stage2_ab_training",
                "extra": {"rollout_matching": {"rollout_backend": "hf"}},
            },
            "stage2_ab": {"schedule": {"b_ratio": 0.0}},
        },
    )
    output = run.stdout + run.stderr
    assert run.returncode != 0, output[-4000:]
    assert "rank 1: ValueError: a broken record in call 3" in output, output[-4000:]
    assert "Timed out" not in output, output[-4000:]
    assert elapsed < budget < timeout_s
    print(f"one-rank failure: job exited with {run.returncode} after {elapsed:.0f}s (timeout {timeout_s}s)")


def test_both_wordings_of_a_gloo_timeout_are_fatal_distributed_errors() -> None:
    """Under CPU load gloo reports a collective timeout as a closed pair: rank 0 then raised it without
    the fatal-error handling (no log line, no bounded exit) because only "timed out" was recognised."""
    from rollmatch.collectives import is_fatal_distributed_error

    assert is_fatal_distributed_error(RuntimeError("Application timeout caused pair closure"))
    assert is_fatal_distributed_error(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Timed out waiting"))
    assert not is_fatal_distributed_error(RuntimeError("a broken record in call 3"))
