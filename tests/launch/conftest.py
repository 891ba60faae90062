"""Fixtures of the launch tests: a server-mode config on the tiny model, running ``rollmatch launch``,
and the orphan check over the recorded pids.

- ``config_writer`` (= :func:`write_config`) / ``launch_config``: a YAML config (stage2_ab_training, micro Channel-B, server
  mode with no servers listed: the launcher writes them) deep-merged with ``sections``; the fixture
  points it at the tiny model and real shapes data.
- ``start_launch``: start ``python -m rollmatch.cli launch ...`` as a real subprocess (console output to
  a file), returning a :class:`LaunchRun`; ``stand_ins=True``: the same launch with stand-in server and
  learner processes (tests/launch/stand_in_launch.py), for tests of the launcher's supervision.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from rollmatch.config.load import deep_merge

REPO = Path(__file__).resolve().parents[2]
STAND_IN_LAUNCH = Path(__file__).with_name("stand_in_launch.py")


@dataclass
class LaunchRun:
    """A running ``rollmatch launch``; its console output goes to ``console_path``."""

    process: subprocess.Popen[bytes]
    console_path: Path
    launch_dir: Path

    def output(self) -> str:
        return self.console_path.read_text(errors="replace")

    def wait(self, timeout_s: float) -> int:
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGTERM)  # the launcher's own teardown, then fail
            self.process.wait(timeout=60)
            pytest.fail(f"launch did not finish in {timeout_s}s:\n{self.output()[-6000:]}")

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if self.process.poll() is not None:
                pytest.fail(
                    f"launch exited ({self.process.returncode}) before {what}:\n{self.output()[-6000:]}"
                )
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} after {timeout_s}s:\n{self.output()[-6000:]}")
            time.sleep(0.5)

    def pids(self, name: str = "pids.json") -> dict[str, Any]:
        return json.loads((self.launch_dir / name).read_text())


@pytest.fixture(scope="session")
def launch_shapes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from rollmatch.data.shapes import generate_shapes

    return generate_shapes(tmp_path_factory.mktemp("launch_shapes"), n_train=8, n_val=0, size=112, seed=0)


def write_config(path: Path, *, model: str, train_jsonl: str, output_dir: Path, **sections: Any) -> Path:
    """A stage2_ab_training server-mode config (no servers listed) deep-merged with ``sections``."""
    base: dict[str, Any] = {
        "model": {"path": model},
        "data": {"train_jsonl": train_jsonl, "val_jsonl": None},
        "custom": {
            "trainer_variant": "stage2_ab_training",
            "extra": {
                "rollout_matching": {
                    "rollout_backend": "vllm",
                    "max_new_tokens": 12,
                    "vllm": {"mode": "server", "server": {"timeout_s": 180}, "sync": {"mode": "full"}},
                }
            },
        },
        "stage2_ab": {"schedule": {"b_ratio": 0.5}, "channel_b": {"mode": "micro"}},
        "preflight": {"records": 0},  # rollout training from an untrained model: no format check
        "training": {
            "output_dir": str(output_dir),
            "per_device_train_batch_size": 1,
            "max_steps": 2,
            "learning_rate": 3e-3,
            "logging_steps": 1,  # the tests read every step's metrics
            "report_to": [],
            "save_steps": 1000,
            "packing": True,
            "global_max_length": 1024,
            "collective_timeout_s": 200,  # leaves the first push's group init (server timeout_s 180) its margin
        },
    }
    path.write_text(yaml.safe_dump(deep_merge(base, sections)))
    return path


@pytest.fixture
def config_writer() -> Callable[..., Path]:
    """:func:`write_config` for tests that need no real model (pure planning)."""
    return write_config


@pytest.fixture
def launch_config(
    tiny_model_dir: Path, launch_shapes: dict[str, Path], tmp_path: Path
) -> Callable[..., Path]:
    """``launch_config(**sections)``: a config on the tiny model and real shapes data."""

    def write(**sections: Any) -> Path:
        return write_config(
            tmp_path / "launch.yaml",
            model=str(tiny_model_dir),
            train_jsonl=str(launch_shapes["train"]),
            output_dir=tmp_path / "out",
            **sections,
        )

    return write


@pytest.fixture
def start_launch(tmp_path: Path) -> Iterator[Callable[..., LaunchRun]]:
    runs: list[LaunchRun] = []

    def start(config: Path, *args: str, stand_ins: bool = False) -> LaunchRun:
        console = tmp_path / f"console-{len(runs)}.txt"
        launch = [str(STAND_IN_LAUNCH)] if stand_ins else ["-m", "rollmatch.cli", "launch"]
        with console.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, *launch, str(config), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env=dict(os.environ),
            )
        run = LaunchRun(process, console, tmp_path / "out" / "launch")
        runs.append(run)
        return run

    yield start
    for run in runs:  # a failed test must not leave a launch (and its children) behind
        if run.process.poll() is None:
            run.process.send_signal(signal.SIGTERM)
            run.process.wait(timeout=60)
