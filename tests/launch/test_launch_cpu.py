"""``rollmatch launch --cpu`` with real processes: rollout server(s), a 2-rank torchrun learner, the
health wait, teardown on every ending, and no orphan left (checked against the recorded pids).

The end-to-end test runs per (server engine, Channel-B mode) entry of :data:`RUNS`; the hf engine
with async Channel-B runs in the two-node test (one launch per node).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests

from rollmatch.launch.processes import survivors

RUNS = [("vllm", "micro")]
RUN_TIMEOUT_S = 420
CPU_2_RANKS = ("--cpu", "--servers", "1", "--learner-procs", "2")


@pytest.mark.heavy
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize(("engine", "channel_b_mode"), RUNS)
def test_cpu_launch_trains_end_to_end(
    engine: str, channel_b_mode: str, launch_config: Callable[..., Path], start_launch: Callable[..., Any]
) -> None:
    if engine == "vllm":
        pytest.importorskip("vllm")
    # A pixel budget below the model's own changes the image-token count: the server must apply it too.
    config = launch_config(
        data={"max_pixels": 6272},
        stage2_ab={"schedule": {"b_ratio": 0.5}, "channel_b": {"mode": channel_b_mode}},
    )
    run = start_launch(config, *CPU_2_RANKS, "--engine", engine)
    code = run.wait(RUN_TIMEOUT_S)
    output = run.output()
    assert code == 0, output[-6000:]
    assert output.count("trained 2 steps") == 2, output[-6000:]  # both learner ranks
    assert "[launch] server-0 healthy at http://127.0.0.1:" in output
    assert "learner finished with exit code 0" in output.splitlines()[-1]

    out = run.launch_dir.parent
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rollout_step = next(h for h in steps if h.get("stage2_ab/step_kind_b") == 1)  # step 2 is Channel-B
    assert rollout_step["rollout/count"] == 2  # one rollout per rank, from the launched server
    assert rollout_step["rollout/weight_version"] == 1  # rank 0 pushed its weights before step 2
    learner_cfg = (run.launch_dir / "learner.yaml").read_text()
    assert "base_url: http://127.0.0.1:" in learner_cfg and "max_pixels: 6272" in learner_cfg
    assert f"rollout server ({engine} engine" in (run.launch_dir / "server-0.log").read_text()
    pids = run.pids()
    assert [p["name"] for p in pids["processes"]] == ["server-0", "learner-0"]
    assert len(pids["processes"][1]["descendants"]) >= 2  # torchrun's two workers were recorded
    assert survivors(pids) == []
    assert "ROLLMATCH_API_KEY=" not in output.replace("ROLLMATCH_API_KEY='<redacted>'", "")


@pytest.mark.heavy
@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_a_server_killed_mid_run_stops_the_launch_with_its_name_and_leaves_no_process(
    launch_config: Callable[..., Path], start_launch: Callable[..., Any]
) -> None:
    """The launcher's side of a server dying mid-run: stand-in server and learner processes
    (tests/launch/stand_in_launch.py; the learner's workers poll the server with the launch's key and
    fail once it is gone, as the trainer does). A real server and learner: the end-to-end tests."""
    config = launch_config(stage2_ab={"schedule": {"b_ratio": 1.0}}, training={"max_steps": 100000})
    cpu = ("--cpu", "--learner-procs", "2", "--engine", "hf", "--grace-s", "5")
    run = start_launch(config, *cpu, stand_ins=True)
    learner_log = run.launch_dir / "learner-0.log"
    run.wait_for(lambda: learner_log.exists() and "| loss " in learner_log.read_text(), 300, "a trained step")
    run.wait_for(lambda: len(run.pids()["processes"][1]["descendants"]) == 2, 60, "recorded workers")

    pids = run.pids()
    server, learner = pids["processes"]
    key = _environ(server["pid"])["ROLLMATCH_API_KEY"]
    assert len(key) >= 32 and _environ(learner["pid"])["ROLLMATCH_API_KEY"] == key  # one fresh key, shared
    assert all(_environ(w["pid"])["ROLLMATCH_API_KEY"] == key for w in learner["descendants"])
    planned = json.loads((run.launch_dir / "planned_commands.json").read_text())
    assert planned["server-0"][2:4] == ["rollmatch.cli", "serve"]  # the commands the real launch runs ...
    assert planned["learner-0"][2] == "torch.distributed.run"
    for command in planned.values():
        assert key not in " ".join(command)  # ... never carry the key
    for record in [server, learner, *learner["descendants"]]:
        assert key not in _cmdline(record["pid"])  # never on a command line ...
    os.kill(server["pid"], signal.SIGKILL)
    code = run.wait(60)
    output = run.output()
    assert code == 3, output[-4000:]
    assert (
        "rollout server server-0" in output and "exited with code -9 while the learner was running" in output
    )
    assert key not in output  # ... never printed
    assert survivors(run.pids()) == [], run.pids()


@pytest.mark.heavy
def test_a_server_that_dies_during_start_up_fails_the_launch_with_its_log(
    tmp_path: Path,
    config_writer: Callable[..., Path],
    start_launch: Callable[..., Any],
    tiny_model_dir: Path,
    launch_shapes: dict[str, Path],
) -> None:
    # A model directory that passes the input checks (config.json, processor) but whose weights
    # cannot load: the server dies while it starts.
    broken = tmp_path / "broken_model"
    shutil.copytree(tiny_model_dir, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    config = config_writer(
        tmp_path / "launch.yaml",
        model=str(broken),
        train_jsonl=str(launch_shapes["train"]),
        output_dir=tmp_path / "out",
    )
    run = start_launch(config, *CPU_2_RANKS, "--engine", "hf")
    code = run.wait(120)
    output = run.output()
    assert code == 3, output
    assert "rollout server server-0" in output and "during start-up, before /health/ answered" in output
    assert "safetensors" in output.split("Last lines of")[-1].lower()  # the log tail names the cause
    assert not (run.launch_dir / "learner-0.log").exists()  # the learner never started
    assert survivors(run.pids()) == []


@pytest.mark.heavy
def test_sigterm_while_waiting_for_the_servers_stops_everything(
    launch_config: Callable[..., Path], start_launch: Callable[..., Any]
) -> None:
    run = start_launch(launch_config(), *CPU_2_RANKS, "--engine", "hf")
    run.wait_for(lambda: "started server-0" in run.output(), 120, "a started server")
    run.process.send_signal(signal.SIGTERM)
    code = run.wait(60)
    assert code == 128 + signal.SIGTERM, run.output()
    assert "received SIGTERM: stopped every process" in run.output()
    assert not (run.launch_dir / "learner-0.log").exists()
    assert survivors(run.pids()) == []


@pytest.mark.heavy
def test_servers_only_keeps_serving_until_ctrl_c_and_leaves_the_key_for_the_learner(
    launch_config: Callable[..., Path], start_launch: Callable[..., Any]
) -> None:
    """The launcher's side, with a stand-in server (tests/launch/stand_in_launch.py) that, like
    ``rollmatch serve``, answers ``/info/`` only to the launch's key."""
    run = start_launch(launch_config(), "--cpu", "--servers-only", "--engine", "hf", stand_ins=True)
    run.wait_for(lambda: "rollout server(s) ready" in run.output(), 240, "ready servers")
    key_file = run.launch_dir / "api_key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    learner_cfg = (run.launch_dir / "learner.yaml").read_text()
    url = learner_cfg.split("base_url: ")[1].split()[0]
    assert requests.get(f"{url}/health/", timeout=10).status_code == 200
    key = key_file.read_text().strip()
    assert requests.get(f"{url}/info/", timeout=10).status_code == 401
    # the key in the file is the one the server got: a learner started with it is let in
    assert requests.get(f"{url}/info/", headers={"Authorization": f"Bearer {key}"}, timeout=10).ok
    assert key not in run.output()
    run.process.send_signal(signal.SIGINT)
    assert run.wait(60) == 0, run.output()
    assert survivors(run.pids()) == []


@pytest.mark.heavy
def test_learner_only_returns_the_learners_exit_code(
    launch_config: Callable[..., Path], start_launch: Callable[..., Any], free_port: Callable[[], int]
) -> None:
    nobody = [{"base_url": f"http://127.0.0.1:{free_port()}", "group_port": free_port()}]
    server = {"servers": nobody, "timeout_s": 1}  # nobody listens: any timeout shows the failure
    config = launch_config(custom={"extra": {"rollout_matching": {"vllm": {"server": server}}}})
    run = start_launch(config, "--cpu", "--learner-only", "--learner-procs", "1")
    code = run.wait(240)
    output = run.output()
    assert code == 1, output[-4000:]  # torchrun's code for a failed worker
    assert "learner failed with exit code 1" in output.splitlines()[-1]
    assert "is not reachable after 1s" in (run.launch_dir / "learner-0.log").read_text()
    assert survivors(run.pids("pids-learner.json")) == []


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if b"=" in item)


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def _ports_for_two_nodes() -> tuple[int, int, int]:
    """A port base whose next port (the server's weight-sync group) is free too, and a rendezvous and a
    heartbeat port apart from both (free_ports(3) alone may hand out port_base + 1 as one of them)."""
    from rollmatch.launch.plan import free_ports

    for _ in range(50):
        base, rdzv, heartbeat = free_ports(3)
        if {base, base + 1}.isdisjoint({rdzv, heartbeat}):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                try:
                    probe.bind(("", base + 1))
                except OSError:
                    continue
            return base, rdzv, heartbeat
    raise RuntimeError("no port base with its next port free in 50 tries")


def two_node_config(
    launch_config: Callable[..., Path],
    *,
    max_steps: int = 2,
    grace_s: float = 10,
    heartbeat_timeout_s: float = 30,
) -> tuple[Path, int]:
    """Two nodes on 127.0.0.1 (node 0: one hf server and a learner rank; node 1: a learner rank),
    async Stage-2 AB; the config and its port base."""
    port_base, rdzv, heartbeat = _ports_for_two_nodes()
    config = launch_config(
        training={"max_steps": max_steps},
        stage2_ab={"schedule": {"b_ratio": 0.5}, "channel_b": {"mode": "async"}},
        launch={
            "engine": "hf",
            "port_base": port_base,
            "grace_s": grace_s,
            "nodes": {
                "count": 2,
                "hosts": ["127.0.0.1", "127.0.0.1"],
                "rendezvous": f"127.0.0.1:{rdzv}",
                "roles": ["both", "learner"],
                "join_timeout_s": 120,
                "heartbeat_port": heartbeat,
                "heartbeat_timeout_s": heartbeat_timeout_s,
            },
        },
    )
    return config, port_base


@pytest.mark.heavy
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_two_nodes_on_loopback_train_with_one_rendezvous(
    launch_config: Callable[..., Path], start_launch: Callable[..., Any]
) -> None:
    """Two launches, node ranks 0 (one server + a learner rank) and 1 (a learner rank), one rendezvous:
    a 2-rank async Stage-2 AB run over both trains to max_steps and both exit 0."""
    config, port_base = two_node_config(launch_config)
    nodes = [start_launch(config, f"launch.nodes.rank={rank}", "--cpu") for rank in (0, 1)]
    codes = [run.wait(RUN_TIMEOUT_S) for run in nodes]
    outputs = [run.output() for run in nodes]
    assert codes == [0, 0], "\n\n".join(o[-4000:] for o in outputs)
    assert sum(o.count("trained 2 steps") for o in outputs) == 2, outputs[0][-4000:]
    assert "[launch] server-0 healthy at http://127.0.0.1:" in outputs[0]
    for rank, run in enumerate(nodes):
        node_dir = run.launch_dir / f"node-{rank}"
        assert f"base_url: http://127.0.0.1:{port_base}" in (node_dir / "learner.yaml").read_text()
        assert survivors(json.loads((node_dir / "pids.json").read_text())) == []
    out = nodes[0].launch_dir.parent  # the actors rolled out from node 0's server; every pack accounted for
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [h["stage2_ab/async/ver"] for h in steps if "loss" in h] == [0, 1]
    for rank in (0, 1):
        accounting = json.loads((out / "async" / f"rank{rank}.json").read_text())
        assert accounting["balance"] == 0 and accounting["actor_failure"] is None


@pytest.mark.heavy
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_killing_one_nodes_launcher_stops_the_other_naming_the_lost_node(
    launch_config: Callable[..., Path], start_launch: Callable[..., Any]
) -> None:
    """The two nodes of the test above (node 1's learner waits for node 0's server first), training
    long, with stand-in server and learner processes (tests/launch/stand_in_launch.py: this is about the
    launchers; the run above trains for real). A SIGKILL of node 1's launcher: node 0 exits 4 within the
    heartbeat timeout naming node 1, and no child of either launcher survives (node 1's are stopped by
    its watchdog)."""
    timeout_s, grace_s = 5, 5
    config, port_base = two_node_config(
        launch_config, max_steps=10_000, grace_s=grace_s, heartbeat_timeout_s=timeout_s
    )
    nodes = [start_launch(config, f"launch.nodes.rank={rank}", "--cpu", stand_ins=True) for rank in (0, 1)]
    for run in nodes:
        run.wait_for(lambda run=run: "started learner-0" in run.output(), 240, "the node's learner")
    assert f"remote server http://127.0.0.1:{port_base} healthy" in nodes[1].output()
    for rank, run in enumerate(nodes):  # both nodes' learners are in their training loops
        log = run.launch_dir / f"node-{rank}" / "learner-0.log"
        run.wait_for(lambda log=log: log.exists() and "| loss " in log.read_text(), 240, "a trained step")
    os.kill(nodes[1].process.pid, signal.SIGKILL)
    killed = time.monotonic()
    code = nodes[0].wait(120)
    took = time.monotonic() - killed
    output = nodes[0].output()
    assert code == 4, output[-4000:]
    last = output.splitlines()[-1]
    assert (
        "node 1 (127.0.0.1) lost: no heartbeat for" in last and "launch.nodes.heartbeat_timeout_s=5" in last
    )
    assert took < timeout_s + grace_s + 15, took  # detection, then the server's teardown
    for rank, run in enumerate(nodes):
        record = json.loads((run.launch_dir / f"node-{rank}" / "pids.json").read_text())
        deadline = time.monotonic() + grace_s + 20  # node 1's watchdog: SIGTERM, SIGKILL after the grace
        while survivors(record) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert survivors(record) == [], f"node {rank}"
