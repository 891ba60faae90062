"""Real ``rollmatch serve`` processes on free 127.0.0.1 ports, for the server tests and their fixtures.

A module of its own (not ``conftest``) so tests import it by a name no other test folder shares.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

REPO = Path(__file__).resolve().parents[2]
RACCOON = REPO.parent / "shared" / "data" / "raccoon" / "images"
START_TIMEOUT_S = 240.0


@dataclass
class ServerProcess:
    url: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    step_gate: Path | None = (
        None  # started by ``gated_server.py``: this file, while it exists, holds every step
    )

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def get(self, path: str, api_key: str | None = None) -> Any:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        reply = requests.get(f"{self.url}{path}", headers=headers, timeout=30)
        reply.raise_for_status()
        return reply.json()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=20)


def launch_server(
    model_dir: Path,
    port: int,
    log_path: Path,
    *extra: str,
    command: list[str] | None = None,
    step_gate: Path | None = None,
) -> ServerProcess:
    """Start ``rollmatch serve`` and wait until ``/health/`` answers (or fail with the server log).
    ``command``: what runs in place of ``python -m rollmatch.cli`` (a fault-injecting stand-in);
    ``step_gate``: run it as ``gated_server.py`` with this gate file (see there)."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    if step_gate is not None:
        command = [sys.executable, str(Path(__file__).with_name("gated_server.py"))]
        env["ROLLMATCH_TEST_STEP_GATE"] = str(step_gate)
    if command is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    command = [
        *(command or [sys.executable, "-m", "rollmatch.cli"]),
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        *extra,
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    server = ServerProcess(f"http://127.0.0.1:{port}", port, process, log_path, step_gate)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"rollout server exited with {process.returncode}:\n{server.log_tail()}")
        try:
            if requests.get(f"{server.url}/health/", timeout=2).status_code == 200:
                return server
        except requests.RequestException:
            pass  # not listening yet
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"rollout server not healthy after {START_TIMEOUT_S}s:\n{server.log_tail()}")
