"""Chaos: a rollout server SIGKILLed in the middle of an async run under ``rollmatch launch --cpu``.

Two hf-engine servers, a 2-rank gloo learner, ``vllm.server.min_healthy: 1`` and
``launch.restart_servers: 1``. The run must finish every step with exit 0; its clients fail over
(``servers/failovers`` >= 1: an actor whose call was in flight, or the learner's push); the launcher restarts the server on its port; the learner's next push
re-syncs it and it serves rollouts again at the learner's version before the run ends; the record trace
and the accounting show no record trained twice and every rollout counted. The learner is paused (SIGSTOP)
from the kill until the new server process answers: real steps take longer than a restart, these tiny ones
do not (a fast machine trained 240 of them in 29 s, under the restart's time), and the test must not depend on
which is faster. (With the default settings
the same kill fails the run naming the server: tests/launch/test_launch_cpu.py and
tests/server/test_async_learner.py keep that contract.)
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

from rollmatch.launch.processes import survivors

pytestmark = pytest.mark.heavy
RUN_TIMEOUT_S = 480
# Cheap steps (0.1-0.5 s). The learner is paused through the restart, so what the run must outlast is
# counted in steps, not seconds: the kill comes a step or two after the first logged one (a push to the
# stopped server holds the learner), and the re-sync is tried at the pushes after the server answers again
# (server_pool's re-sync skips count pushes). Killed after step 2 or 3, it served again at version 8 to
# 10, idle and on a machine loaded 4x over its 2 cores: 100 steps is 10x that; every step beyond is one
# the run trains after the test's point was made (it trained 240).
STEPS = 100


def _server_record(run: Any, name: str) -> dict[str, Any]:
    """The newest record of ``name`` in the launch record (a restarted server appears twice)."""
    return [p for p in run.pids()["processes"] if p["name"] == name][-1]


def _api_key(pid: int) -> str:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in environ if b"=" in e)["ROLLMATCH_API_KEY"]


def _learner_processes(run: Any) -> list[psutil.Process]:
    """Every learner process (torchrun agent and its ranks) this launch started."""
    roots = [psutil.Process(p["pid"]) for p in run.pids()["processes"] if p["name"].startswith("learner")]
    return [proc for root in roots for proc in (root, *root.children(recursive=True))]


def _logged(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [h for h in map(json.loads, path.read_text().splitlines()) if "loss" in h]


def _unread_request(port: int) -> bool:
    """Whether a connection to ``port`` on this host holds bytes its server has not read (/proc/net/tcp*)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            rx_queue = int(fields[4].split(":")[1], 16)
            if local_port == port and fields[3] == "01" and rx_queue > 0:  # 01: ESTABLISHED
                return True
    return False


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False  # still starting


@pytest.mark.timeout(RUN_TIMEOUT_S + 310)
def test_a_killed_server_is_restarted_resynced_and_serves_again_while_the_run_trains_on(
    launch_config: Callable[..., Path], start_launch: Callable[..., Any], tmp_path: Path
) -> None:
    config = launch_config(
        # rotate_servers: the actors' calls are often of one request; under the seed's rule (chunk i to
        # server i) those all go to server-0 and the restarted server-1 would get none to serve
        custom={
            "extra": {
                "rollout_matching": {
                    "vllm": {"server": {"timeout_s": 120, "min_healthy": 1, "rotate_servers": True}}
                }
            }
        },
        stage2_ab={
            "schedule": {"b_ratio": 1.0},
            "channel_b": {
                "mode": "async",
                "rollout_decode_batch_size": 2,
                "async": {"version_window": 2, "max_wait_s": 30.0, "record_trace": True},
            },
        },
        # collective_timeout_s: a failover push may form groups twice (2 x timeout_s) below it
        training={"max_steps": STEPS, "global_max_length": 320, "collective_timeout_s": 300},
        launch={"restart_servers": 1, "restart_backoff_s": 0.1},  # the killed server's port is free at once
    )
    out = tmp_path / "out"
    run = start_launch(config, "--cpu", "--servers", "2", "--learner-procs", "2", "--engine", "hf")
    run.wait_for(lambda: len(_logged(out)) >= 1, 300, "a trained step")
    victim = _server_record(run, "server-1")
    url = next(
        line.split(" healthy at ")[1].split()[0]
        for line in run.output().splitlines()
        if "server-1 healthy at" in line
    )
    # Stopped first, so a request is surely in flight (sent, unread) when it dies: an actor's rollout call, or
    # the learner's push (failing over either way), or the launcher's health probe (the next push then fails).
    os.kill(victim["pid"], signal.SIGSTOP)
    port = int(url.rsplit(":", 1)[1])
    run.wait_for(lambda: _unread_request(port), 60, "a rollout call sent to the stopped server-1")
    learner = _learner_processes(run)
    for proc in learner:
        proc.suspend()
    try:
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at_step = len(_logged(out))
        # The launcher restarts it (the learner paused meanwhile, see the module docstring) ...
        run.wait_for(lambda: _server_record(run, "server-1")["pid"] != victim["pid"], 60, "the restart")
        restarted = _server_record(run, "server-1")
        headers = {"Authorization": f"Bearer {_api_key(restarted['pid'])}"}
        # a fresh server process: 25 s on an idle machine, so 10x that (a server that never answers fails)
        run.wait_for(lambda: _answers(f"{url}/health/"), 250, "the restarted server's health")
    finally:
        for proc in learner:
            proc.resume()
    # ... the learner's next push fails on it and re-syncs it once it answers; the actors use it again.
    seen: dict[str, Any] = {}

    def serves_again() -> bool:
        try:
            stats = requests.get(f"{url}/stats/", headers=headers, timeout=5).json()
        except requests.RequestException:
            return False  # still starting
        if str(stats["weight_version"]) not in stats["pushes_by_version"]:
            # Not re-synced yet. A call may reach it meanwhile (an actor's call re-sent on a fresh connection
            # after the kill): it answers at version 0 and the client drops that answer (check_served).
            return False
        logged = _logged(out)
        seen.update(stats=stats, learner_version=logged[-1]["stage2_ab/async/ver"] if logged else -1)
        seen.setdefault("calls_when_resynced", stats["infer_calls"])
        return stats["infer_calls"] > seen["calls_when_resynced"]  # a call served since the re-sync

    run.wait_for(serves_again, 240, "the restarted server serving rollouts again")
    stats = seen["stats"]
    # It serves a version the learner pushed to it, at least the one the learner had when it was asked.
    assert str(stats["weight_version"]) in stats["pushes_by_version"], stats
    assert stats["weight_version"] >= seen["learner_version"], seen
    assert len(_logged(out)) < STEPS, (
        "the run ended before the restarted server served: the test proves nothing"
    )

    code = run.wait(RUN_TIMEOUT_S)
    output = run.output()
    assert code == 0, output[-6000:]
    assert "restarting it in 0.1s on the same devices and port (restart 1 of 1)" in output, output[-6000:]
    # rank 0's push to the dead server failed: only that server was dropped, the push sent again to the other
    assert "sending it again to ['http://127.0.0.1:" in output, output[-6000:]
    assert "answer again: re-syncing them" in output, output[-6000:]
    logged = _logged(out)
    assert len(logged) == STEPS
    # Marked down by whichever client met it first: an actor whose call was in flight, or the pusher (a
    # restarted server has no weight-sync group, so the next push to it fails): which one is timing.
    assert sum(h.get("servers/failovers", 0.0) for h in logged) >= 1
    assert "marked down (1 of 2 servers left)" in output, output[-6000:]
    for rank in (0, 1):
        trace = [
            json.loads(line)
            for line in (out / "async" / f"rank{rank}.records.jsonl").read_text().splitlines()
        ]
        positions = [r[0] for line in trace for r in line["records"]]
        assert len(positions) == len(set(positions)), "a record was trained or dropped twice"
        counts = json.loads((out / "async" / f"rank{rank}.json").read_text())
        assert counts["actor_failure"] is None and counts["balance"] == 0, counts
        rollouts = counts["rollouts"]
        assert rollouts["balance"] == 0 and rollouts["rolled_out"] == (
            rollouts["trained"]
            + rollouts["dropped_stale"]
            + rollouts["dropped_oldest"]
            + rollouts["discarded_at_exit"]
        ), rollouts
    assert survivors(run.pids()) == []
    print(f"killed server-1 after step {killed_at_step}; it served again at v{stats['weight_version']}")
