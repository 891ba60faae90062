"""``launch.restart_servers``: the supervisor restarts a rollout server that exits or freezes, with the
same command and port, logs each restart, and gives up naming a server that keeps failing.

Real processes: a stand-in server (a small HTTP server answering ``/health/`` on its port, which exits
or freezes itself with SIGSTOP once it answered its first health check, so the supervisor saw it up)
and a stand-in learner that exits 0 once the server was started a second time (a gate on the restart
itself, not a sleep that must outlast it) or, in the give-up case, runs until the supervisor stops it.
The full chaos run with real servers and a real learner is tests/launch/test_server_restart.py.
"""

from __future__ import annotations

import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
from local_ports import free_tcp_port

from rollmatch.config.schema import RollmatchConfig
from rollmatch.launch.layout import Layout
from rollmatch.launch.plan import LaunchPlan, ProcessSpec
from rollmatch.launch.supervisor import EXIT_SERVER_FAILED, run_plan

SERVER = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    from http.server import BaseHTTPRequestHandler, HTTPServer

    port, fault, marker = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    first_run = not os.path.exists(marker)
    open(marker, "a").write("started\\n")

    answered = threading.Event()

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            answered.set()

        def log_message(self, *args):
            pass

    def fault_later():
        answered.wait()  # the supervisor has seen this server healthy
        time.sleep(0.2)  # the answer reached it before the fault
        print(f"stand-in server: {fault}", flush=True)
        if fault == "exit-once" and first_run:
            os._exit(1)
        if fault == "exit-always":
            os._exit(1)
        if fault == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)

    threading.Thread(target=fault_later, daemon=True).start()
    server = HTTPServer(("127.0.0.1", port), Health)
    server.allow_reuse_address = True
    server.serve_forever()
    """
)


# Exits 0 once the server was started twice (the restart happened), 1 if that never comes.
LEARNER_UNTIL_RESTARTED = textwrap.dedent(
    """
    import pathlib, sys, time

    starts, deadline = pathlib.Path(sys.argv[1]), time.monotonic() + 100
    while not (starts.exists() and starts.read_text().count("started") >= 2):
        if time.monotonic() > deadline:
            sys.exit("stand-in learner: the server was never restarted")
        time.sleep(0.05)
    """
)
LEARNER_FOREVER = "import time; time.sleep(600)"  # until the supervisor stops it
# Exits 0 once the file named by its second argument exists (the test's gate), 1 if it never comes.
LEARNER_UNTIL_GATE = textwrap.dedent(
    """
    import pathlib, sys, time

    gate, deadline = pathlib.Path(sys.argv[2]), time.monotonic() + 100
    while not gate.exists():
        if time.monotonic() > deadline:
            sys.exit("stand-in learner: the gate was never opened")
        time.sleep(0.05)
    """
)


def _plan(tmp_path: Path, fault: str, learner: str) -> LaunchPlan:
    script = tmp_path / "stand_in_server.py"
    script.write_text(SERVER)
    port = free_tcp_port()
    server = ProcessSpec(
        role="server",
        index=0,
        command=(sys.executable, str(script), str(port), fault, str(tmp_path / "starts.txt")),
        env={},
        log_path=tmp_path / "server-0.log",
        url=f"http://127.0.0.1:{port}",
    )
    learner = ProcessSpec(
        role="learner",
        index=0,
        command=(sys.executable, "-c", learner, str(tmp_path / "starts.txt")),
        env={},
        log_path=tmp_path / "learner-0.log",
    )
    return LaunchPlan(
        servers=(server,),
        learner=learner,
        endpoints=(),
        learner_config=RollmatchConfig(),
        learner_config_path=tmp_path / "learner.yaml",
        launch_dir=tmp_path,
        health_timeout_s=3.0,
        layout=Layout(
            on_cpu=True, server_devices=(), learner_devices=(), learner_procs=1, tensor_parallel_size=1
        ),
        engine="hf",
        restart_servers=1,
        restart_backoff_s=0.1,  # the stand-in's port is free once it exited or was killed: no wait needed
    )


@pytest.mark.timeout(120)
def test_a_server_that_exits_is_restarted_on_its_port_and_the_run_finishes(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    assert run_plan(_plan(tmp_path, "exit-once", LEARNER_UNTIL_RESTARTED), grace_s=1.0) == 0
    output = capfd.readouterr().out
    assert "rollout server server-0 (http://127.0.0.1:" in output
    assert "exited with code 1: restarting it in 0.1s on the same devices and port (restart 1 of 1)" in output
    assert "learner finished with exit code 0" in output
    assert (tmp_path / "starts.txt").read_text().count("started") == 2
    assert "exit-once" in (tmp_path / "server-0.before-restart-1.log").read_text()  # the first run's log kept


@pytest.mark.timeout(120)
def test_a_frozen_server_is_restarted_then_given_up_naming_it(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    assert run_plan(_plan(tmp_path, "freeze", LEARNER_FOREVER), grace_s=1.0) == EXIT_SERVER_FAILED
    output = capfd.readouterr().out
    assert "did not answer /health/ for" in output and "restart 1 of 1" in output
    last = output[output.index("after 1 restart(s)") - 200 :]
    assert (
        "rollout server server-0 (http://127.0.0.1:" in last
        and "given up (launch.restart_servers = 1)" in last
    )
    assert (tmp_path / "starts.txt").read_text().count("started") == 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("restarts", [0, 1])
def test_a_server_out_of_restarts_is_left_down_while_the_others_meet_min_healthy(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, restarts: int
) -> None:
    """Two servers, ``min_healthy: 1``: the one that keeps exiting is restarted ``restarts`` times, then
    left down, and the launch goes on until the learner finishes (it trains on the other server); with
    ``min_healthy`` null the same exit ends the launch, as before."""
    from rollmatch.config.schema import ServerEndpoint
    from rollmatch.launch.console import ConsoleMerge

    # The gate: the learner finishes once the supervisor said it left the server down (not a sleep that
    # must outlast the restarts); without min_healthy the launch ends before, and the learner is stopped.
    gate = tmp_path / "left_down"
    say = ConsoleMerge.say

    def say_and_open_the_gate(console: ConsoleMerge, message: str) -> None:
        say(console, message)
        if "left down" in message:
            gate.touch()

    monkeypatch.setattr(ConsoleMerge, "say", say_and_open_the_gate)
    base = _plan(tmp_path, "exit-always", LEARNER_UNTIL_GATE)
    base = replace(base, learner=replace(base.learner, command=(*base.learner.command, str(gate))))
    script = tmp_path / "stand_in_server.py"
    port = free_tcp_port()
    healthy = ProcessSpec(
        role="server",
        index=1,
        command=(sys.executable, str(script), str(port), "none", str(tmp_path / "starts-1.txt")),
        env={},
        log_path=tmp_path / "server-1.log",
        url=f"http://127.0.0.1:{port}",
    )
    servers = (base.servers[0], healthy)
    cfg = RollmatchConfig.model_validate(
        {"custom": {"extra": {"rollout_matching": {"vllm": {"server": {"min_healthy": 1}}}}}}
    )
    endpoints = tuple(ServerEndpoint(base_url=s.url or "", group_port=1) for s in servers)
    plan = replace(base, servers=servers, endpoints=endpoints, learner_config=cfg, restart_servers=restarts)
    assert run_plan(plan, grace_s=1.0) == 0
    output = capfd.readouterr().out
    assert f"after {restarts} restart(s) (launch.restart_servers = {restarts}): left down" in output
    assert "the learner trains on with 1 of 2 server(s) (vllm.server.min_healthy = 1)" in output
    assert "learner finished with exit code 0" in output
    assert (tmp_path / "starts.txt").read_text().count("started") == restarts + 1

    every = replace(plan, learner_config=RollmatchConfig(), launch_dir=tmp_path)  # min_healthy null
    (tmp_path / "starts.txt").unlink()
    gate.unlink()  # closed again: only the server's exit can end this launch
    assert run_plan(every, grace_s=1.0) == EXIT_SERVER_FAILED
    assert not gate.exists()
