"""Fixtures of the rollout-server tests: real ``rollmatch serve`` processes on free 127.0.0.1 ports.

- ``start_server``: start a server subprocess, wait (bounded) for ``/health/``; stopped at teardown.
- ``hf_server``: a session-wide HF-engine server on the tiny model that tests must NOT push weights
  to (its outputs are compared with the pristine model); ``hf_server.step_gate``: a file that, while
  it exists, holds its engine steps (``gated_server.py``).
- ``hf_sync_server``: a second session-wide HF-engine server that weight-sync tests may change (gated
  too: the update-under-load test holds its steps).
- ``raccoon_requests``: three trainer-encoded rollout requests on real photos (one grayscale).
- ``server_config``: ``server_config(**server_keys)`` -> a server-mode config on the tiny model.
- ``shared_vllm_engine``: ``.get()`` -> one in-process vLLM server engine for the tests that drive one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fork_ranks import BEFORE_FORK
from local_ports import free_tcp_port
from server_processes import RACCOON, ServerProcess, launch_server

from rollmatch.config.resolved import resolve_run_on_this_machine


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
    def start(model_dir: Path, *extra: str, gated: bool = False) -> ServerProcess:
        port = free_tcp_port()
        folder = tmp_path_factory.mktemp("server")
        gate = folder / "step-gate" if gated else None
        server = launch_server(model_dir, port, folder / "server.log", *extra, step_gate=gate)
        _server_pool.append(server)
        return server

    return start


@pytest.fixture(scope="session")
def hf_server(start_server: Callable[..., ServerProcess], tiny_model_dir: Path) -> ServerProcess:
    return start_server(tiny_model_dir, "--engine", "hf", gated=True)


@pytest.fixture(scope="session")
def hf_sync_server(start_server: Callable[..., ServerProcess], tiny_model_dir: Path) -> ServerProcess:
    return start_server(tiny_model_dir, "--engine", "hf", gated=True)


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


class SharedVllmEngine:
    """One in-process vLLM server engine on the tiny model (``max_model_len`` 1024), started on first
    use and closed once the last test of this directory ran (each start costs seconds)."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.engine: Any = None

    def get(self) -> Any:
        if self.engine is None:
            from rollmatch.server.engines import VllmServerEngine

            self.engine = VllmServerEngine(str(self.model_dir), max_model_len=1024)
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def discard(self) -> None:
        """Forget an engine a failed test may have left wedged (not closed: that could hang); the
        next ``get()`` starts a fresh one."""
        self.engine = None


_SHARED_VLLM: list[SharedVllmEngine] = []


def _close_shared_vllm_engines() -> None:
    for shared in _SHARED_VLLM:
        shared.close()


BEFORE_FORK.append(_close_shared_vllm_engines)  # its gloo world must not reach forked ranks


@pytest.fixture(scope="session")
def shared_vllm_engine(tiny_model_dir: Path) -> Iterator[SharedVllmEngine]:
    """``shared_vllm_engine.get()``: the in-process vLLM engine of the tests that drive one (fuzz,
    faults, update modes). Tests may load weights into it (none compares it with the pristine model)
    and wrap it in their own ``RolloutServer``, but close only that server's scheduler and sync
    session (``app_client`` does), never the engine."""
    pytest.importorskip("vllm")
    shared = SharedVllmEngine(tiny_model_dir)
    _SHARED_VLLM.append(shared)
    yield shared
    shared.close()


@pytest.hookimpl(trylast=True)  # after the fixtures' teardown (servers wrapping the engine close first)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Close the shared vLLM engine when the run leaves this directory (the rest of the session does
    not hold its memory; a later test of this directory starts it again)."""
    here = Path(__file__).parent
    if nextitem is None or nextitem.path.parent != here:
        for shared in _SHARED_VLLM:
            shared.close()


@pytest.fixture
def app_client() -> Iterator[Callable[..., Any]]:
    """``app_client(engine, api_key=None, sync_key=None, **limits)``: the real FastAPI app around a
    fresh ``RolloutServer`` on ``engine``, driven in process (httpx); returns ``(client, server)``."""
    from fastapi.testclient import TestClient

    from rollmatch.server.app import build_app
    from rollmatch.server.limits import ServerLimits
    from rollmatch.server.rollout_server import RolloutServer

    made: list[tuple[Any, Any]] = []

    def make(
        engine: Any, api_key: str | None = None, sync_key: str | None = None, **limits: Any
    ) -> tuple[Any, Any]:
        server = RolloutServer(engine, ServerLimits(**limits), sync_key=sync_key)
        client = TestClient(build_app(server, api_key=api_key), raise_server_exceptions=False)
        made.append((client, server))
        return client, server

    yield make
    for client, server in made:
        client.close()
        server.scheduler.close()
        server.sync.shutdown()


@dataclass
class TrainerSide:
    """What a trainer holds in a server test: its model, a ``ServerBackend`` pushing that model to
    one server, and HF generate on the same model (the reference the server must agree with)."""

    model: Any
    backend: Any  # rollmatch.rollout.client.ServerBackend
    reference: Any  # rollmatch.rollout.hf.HFBackend


@pytest.fixture
def trainer_side(
    server_config: Callable[..., Any],
    tiny_model_dir: Path,
    prompt_encoder: Any,
    free_port: Callable[[], int],
) -> Iterator[Callable[..., TrainerSide]]:
    """``trainer_side(url, **server_keys)``: a fresh tiny model and a ``ServerBackend`` to the server
    at ``url`` (on a free group port; closed at teardown), plus HF generate on the same model."""
    import torch
    from transformers import AutoModelForImageTextToText

    from rollmatch.collectives import LocalCollectives
    from rollmatch.rollout.client import ServerBackend
    from rollmatch.rollout.hf import HFBackend

    opened: list[Any] = []

    def make(url: str, **server_keys: Any) -> TrainerSide:
        model = AutoModelForImageTextToText.from_pretrained(
            tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
        )
        backend = ServerBackend.connect(
            resolve_run_on_this_machine(
                server_config(servers=[{"base_url": url, "group_port": free_port()}], **server_keys)
            ),
            model=model,
            tokenizer=prompt_encoder.tokenizer,
            collectives=LocalCollectives(),
            processor=prompt_encoder.processor,
        )
        opened.append(backend)
        reference = HFBackend(
            model,
            prompt_encoder.tokenizer,
            eos_token_id=prompt_encoder.eos_token_id,
            pad_token_id=prompt_encoder.pad_token_id,
        )
        return TrainerSide(model, backend, reference)

    yield make
    for backend in opened:
        backend.close()
