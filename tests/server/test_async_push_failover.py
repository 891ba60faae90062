"""An async run whose second rollout server dies in the middle of a weight push trains on at ``min_healthy``.

A real ``rollmatch train`` learner (async Channel-B, server mode, ``min_healthy: 1``; forked from the test
process, ``fork_ranks.py``) against two real HF
``rollmatch serve`` processes on 127.0.0.1; the second is ``dying_sync_server.py``: it takes the push's
first bucket and exits hard at the push's next request (here ``/finish_weight_update/``: the tiny model is
one bucket). The run's first push fails on it mid-transfer, is sent again to the live server, every client
drops the dead one, and the run trains every step on the live server and exits 0.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from dying_sync_server import EXIT_CODE
from fork_ranks import train_in_forked_ranks
from server_processes import launch_server
from test_async_learner import RUN_TIMEOUT_S, async_config, make_shapes, step_metrics

pytestmark = pytest.mark.heavy
STEPS = 3


@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
def test_a_server_dying_mid_push_leaves_an_async_run_training_at_min_healthy(
    start_server: Callable[..., Any], tiny_model_dir: Path, tmp_path: Path, free_port: Callable[[], int]
) -> None:
    live = start_server(tiny_model_dir, "--engine", "hf")
    dying = launch_server(
        tiny_model_dir,
        free_port(),
        tmp_path / "dying.log",
        "--engine",
        "hf",
        command=[sys.executable, str(Path(__file__).with_name("dying_sync_server.py"))],
    )
    out = tmp_path / "out"
    config = async_config(
        tiny_model_dir, make_shapes(tmp_path), out, live.url, free_port(), max_steps=STEPS, max_wait_s=30.0
    )
    server = config["custom"]["extra"]["rollout_matching"]["vllm"]["server"]
    server["servers"].append({"base_url": dying.url, "group_port": free_port()})
    server["min_healthy"] = 1
    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(config))
    learner = train_in_forked_ranks(config_path, tmp_path / "logs", world_size=0)  # one plain process
    try:
        code = learner.wait(RUN_TIMEOUT_S, check=False)[0]
        dying.process.wait(timeout=60)
    finally:
        learner.kill()
        dying.stop()
    output = (tmp_path / "logs" / "0" / "output.log").read_text(errors="replace")
    assert code == 0, output[-6000:]
    assert dying.process.returncode == EXIT_CODE and "dying mid-push: finish arrived" in dying.log_tail()
    assert f"rollout server {dying.url} marked down" in output, output[-6000:]
    assert f"sending it again to ['{live.url}']" in output, output[-6000:]  # the push's failover
    logged = step_metrics(out)
    assert [h["step"] for h in logged] == list(range(1, STEPS + 1))
    assert all(h["stage2_ab/step_kind_b"] == 1.0 for h in logged), logged  # every step trained rollouts
    assert all(h["servers/healthy"] == 1.0 for h in logged if "servers/healthy" in h), logged
    assert live.get("/info/")["weight_version"] == STEPS - 1  # the last push reached the live server
