"""``rollmatch launch`` with stand-in server and learner processes, for tests of the launcher's supervision.

``python tests/launch/stand_in_launch.py CONFIG [launch flags]`` runs the real ``rollmatch launch``:
the config and its checks, the plan, the API key, the launch record, the watchdog, the supervisor, its
signals and teardown. Only the command of each planned process is swapped (its environment, log file
and port kept) for a small Python program that speaks the same protocol and imports no torch: a real
server and a real torchrun learner each load torch and transformers for seconds of CPU, which is not
what a test of "the launcher stops everything when a server dies" is about. The end-to-end tests
(tests/launch/test_launch_cpu.py, test_preemption.py, test_server_restart.py) keep the real ones.

- Server: on the planned host and port, ``GET /health/`` answers 200 to anyone and ``GET /info/`` 200
  to a request that carries the launch's API key (``ROLLMATCH_API_KEY`` from its environment), 401
  otherwise, as ``rollmatch serve`` guards every route but ``/health/``.
- Learner (torchrun's place): starts ``--nproc_per_node`` workers in sessions of their own, as torchrun does; each
  "trains" a step every 0.2 s (a ``| loss`` line in the learner's log) while every planned server
  answers ``/info/`` to its key, and exits 1 naming the server once one does not (as the real
  trainer fails on a dead server). SIGTERM is forwarded to the workers, as torchrun does.

The planned (real) commands are written to ``<launch dir>/planned_commands.json`` before anything
starts, so a test can still check what the real launch would run.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Any

from rollmatch.launch.plan import LaunchPlan

SERVER = r"""
import os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

host, port = sys.argv[1], int(sys.argv[2])
key = os.environ.get("ROLLMATCH_API_KEY")

class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        path = self.path.rstrip("/")
        keyed = key is None or self.headers.get("Authorization") == f"Bearer {key}"
        ok = path == "/health" or (path == "/info" and keyed)
        self.send_response(200 if ok else 401 if path == "/info" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

server = ThreadingHTTPServer((host, port), Health)
print(f"stand-in rollout server on http://{host}:{port}", flush=True)
server.serve_forever()
"""

WORKER = r"""
import os, sys, time, urllib.request

rank, urls = sys.argv[1], sys.argv[2:]
key = os.environ.get("ROLLMATCH_API_KEY")
print(f"stand-in worker {rank} up (pid {os.getpid()})", flush=True)
step = 0
while True:
    for url in urls:
        request = urllib.request.Request(f"{url}/info/", headers={"Authorization": f"Bearer {key}"})
        try:
            urllib.request.urlopen(request, timeout=5).close()
        except OSError as exc:
            sys.exit(f"stand-in worker {rank}: rollout server {url} is gone: {exc}")
    step += 1
    print(f"rank {rank} | step {step} | loss 1.0", flush=True)
    time.sleep(0.2)
"""

LEARNER = r"""
import signal, subprocess, sys

worker, nproc, urls = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
workers = [
    subprocess.Popen([sys.executable, "-c", worker, str(rank), *urls], start_new_session=True)
    for rank in range(nproc)
]

def forward(signum, frame):
    for proc in workers:
        proc.send_signal(signum)

signal.signal(signal.SIGTERM, forward)
codes = [proc.wait() for proc in workers]
sys.exit(max(abs(code) for code in codes))
"""


def stand_in_plan(plan: LaunchPlan) -> LaunchPlan:
    """``plan`` with every command swapped for its stand-in; the planned commands saved beside it."""
    plan.launch_dir.mkdir(parents=True, exist_ok=True)
    planned = {spec.name: list(spec.command) for spec in plan.processes}
    (plan.launch_dir / "planned_commands.json").write_text(json.dumps(planned, indent=1))
    servers = []
    for spec in plan.servers:
        host, port = (spec.url or "").removeprefix("http://").rsplit(":", 1)
        servers.append(replace(spec, command=(sys.executable, "-c", SERVER, host, port)))
    learner = plan.learner
    if learner is not None:
        urls = [e.base_url for e in plan.endpoints]
        nproc = learner.command[learner.command.index("--nproc_per_node") + 1]
        learner = replace(learner, command=(sys.executable, "-c", LEARNER, WORKER, nproc, *urls))
    return replace(plan, servers=tuple(servers), learner=learner)


def main(argv: list[str]) -> int:
    import rollmatch.launch.command as command
    from rollmatch.cli import main as cli_main

    run_plan = command.run_plan

    def run_stand_in_plan(plan: LaunchPlan, **kwargs: Any) -> int:
        return run_plan(stand_in_plan(plan), **kwargs)

    # Swapped where the launch runs its plan: everything before (checks, ports, key, the printed plan,
    # the launch record's claim) is the real launch's.
    command.run_plan = run_stand_in_plan  # type: ignore[assignment]
    return cli_main(["launch", *argv])


if __name__ == "__main__":
    from rollmatch.launch.command import exit_launcher

    exit_launcher(main(sys.argv[1:]))  # as python -m rollmatch.cli launch ends
