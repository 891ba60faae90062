"""Fixtures of the rollout-server tests: real ``rollmatch serve`` processes on free 127.0.0.1 ports.

- ``start_server``: start a server subprocess, wait (bounded) for ``/health/``; stopped at teardown.
- ``hf_server``: a session-wide HF-engine server on the tiny model that tests must NOT push weights
  to (its outputs are compared with the pristine model).
- ``hf_sync_server``: a second session-wide HF-engine server that weight-sync tests may change.
- ``raccoon_requests``: three trainer-encoded rollout requests on real photos (one grayscale).
- ``server_config``: ``server_config(**server_keys)`` -> a server-mode config on the tiny model.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

REPO = Path(__file__).resolve().parents[2]
RACCOON = REPO.parent / "shared" / "data" / "raccoon" / "images"
START_TIMEOUT_S = 240.0


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProcess:
    url: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def get(self, path: str) -> Any:
        reply = requests.get(f"{self.url}{path}", timeout=30)
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


def launch_server(model_dir: Path, port: int, log_path: Path, *extra: str) -> ServerProcess:
    """Start ``rollmatch serve`` and wait until ``/health/`` answers (or fail with the server log)."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    command = [
        sys.executable,
        "-m",
        "rollmatch.cli",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        *extra,
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    server = ServerProcess(f"http://127.0.0.1:{port}", port, process, log_path)
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


@pytest.fixture(scope="session")
def _server_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    servers: list[ServerProcess] = []
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def start_server(
    _server_pool: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., ServerProcess]:
    def start(model_dir: Path, *extra: str) -> ServerProcess:
        port = free_tcp_port()
        server = launch_server(model_dir, port, tmp_path_factory.mktemp("server") / "server.log", *extra)
        _server_pool.append(server)
        return server

    return start


@pytest.fixture(scope="session")
def hf_server(start_server: Callable[..., ServerProcess], tiny_model_dir: Path) -> ServerProcess:
    return start_server(tiny_model_dir, "--engine", "hf")


@pytest.fixture(scope="session")
def hf_sync_server(start_server: Callable[..., ServerProcess], tiny_model_dir: Path) -> ServerProcess:
    return start_server(tiny_model_dir, "--engine", "hf")


@pytest.fixture(scope="session")
def prompt_encoder(tiny_model_dir: Path) -> Any:
    from rollmatch.config.schema import DataConfig
    from rollmatch.data.prompts import PromptEncoder

    return PromptEncoder.from_pretrained(tiny_model_dir, DataConfig())


@pytest.fixture(scope="session")
def raccoon_requests(prompt_encoder: Any) -> list[Any]:
    from rollmatch.data.records import Record

    if not RACCOON.is_dir():
        pytest.skip(f"real images not found at {RACCOON}")
    records = [
        Record(id=f"raccoon-{i}", images=(str(RACCOON / f"raccoon-{i}.jpg"),), width=1, height=1)
        for i in (1, 2, 150)
    ]
    return [prompt_encoder.encode(record).to_request() for record in records]


@pytest.fixture(scope="session")
def server_config(tiny_model_dir: Path) -> Callable[..., Any]:
    """``server_config(**server_keys)``: a validated config in server mode on the tiny model."""
    from rollmatch.config.schema import RollmatchConfig

    def build(**server_keys: Any) -> Any:
        raw = {
            "model": {"path": str(tiny_model_dir)},
            "custom": {"extra": {"rollout_matching": {"vllm": {"mode": "server", "server": server_keys}}}},
        }
        return RollmatchConfig.model_validate(raw)

    return build


# ------------------------------------------------------------------------------------ in process
@pytest.fixture(scope="session")
def hf_engine(tiny_model_dir: Path) -> Any:
    """A real HF server engine in this process (shared: tests must not load weights into it)."""
    from rollmatch.server.engines import HFServerEngine

    return HFServerEngine(str(tiny_model_dir), max_model_len=1024)


@pytest.fixture
def app_client() -> Iterator[Callable[..., Any]]:
    """``app_client(engine, api_key=None, **limits)``: the real FastAPI app around a fresh
    ``RolloutServer`` on ``engine``, driven in process (httpx); returns ``(client, server)``."""
    from fastapi.testclient import TestClient

    from rollmatch.server.app import build_app
    from rollmatch.server.limits import ServerLimits
    from rollmatch.server.rollout_server import RolloutServer

    made: list[tuple[Any, Any]] = []

    def make(engine: Any, api_key: str | None = None, **limits: Any) -> tuple[Any, Any]:
        server = RolloutServer(engine, ServerLimits(**limits))
        client = TestClient(build_app(server, api_key=api_key), raise_server_exceptions=False)
        made.append((client, server))
        return client, server

    yield make
    for client, server in made:
        client.close()
        server.sync.shutdown()
