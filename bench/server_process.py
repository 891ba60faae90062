"""A real ``rollmatch serve`` process for the benchmarks, and free ports on 127.0.0.1.

Shared by the bench scripts (they import it from this folder); tests have their own in tests/server.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import requests

SERVER_START_TIMEOUT_S = 180.0
ONE_THREAD = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(
    model_dir: Path,
    port: int,
    log_path: Path,
    *,
    engine: str = "hf",
    coord_frame: str = "norm1000",
    env: Mapping[str, str] = ONE_THREAD,
    timeout_s: float = SERVER_START_TIMEOUT_S,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``rollmatch serve --engine ENGINE --coord-frame COORD_FRAME`` (the benches' trainers pin
    ``norm1000``; ``env`` over this process's environment, output to ``log_path``) and wait until ``/health/`` answers; fail with the log's tail if it exits or
    ``timeout_s`` passes first. ``cwd``: where it runs (``python -m`` imports rollmatch from there first)."""
    command = [sys.executable, "-m", "rollmatch.cli", "serve", "--engine", engine]
    command += ["--model", str(model_dir), "--port", str(port), "--coord-frame", coord_frame]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}, cwd=cwd
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"rollout server exited with {process.returncode}:\n{log_path.read_text()[-3000:]}"
            )
        try:
            if requests.get(f"http://127.0.0.1:{port}/health/", timeout=2).status_code == 200:
                return process
        except requests.RequestException:
            time.sleep(0.5)  # not listening yet
    process.kill()
    raise RuntimeError(f"rollout server not healthy after {timeout_s}s:\n{log_path.read_text()[-3000:]}")
