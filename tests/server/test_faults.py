"""Fault tests against real ``rollmatch serve`` processes: a frozen server, a wedged engine and SIGTERM,
the vLLM seed wedge, and weight sync without the token."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from load_clients import infer_in_process
from local_ports import free_tcp_port
from server_processes import REPO, launch_server
from trainer_backends import connect_backend
from transformers import AutoModelForImageTextToText

from rollmatch.errors import BackendError, SyncError
from rollmatch.rollout.types import Decoding

pytestmark = pytest.mark.heavy
SWIFT_CHAT = {"messages": [{"role": "user", "content": "find"}]}


def test_frozen_server_fails_the_rollout_within_timeout_naming_the_url(
    start_server: Callable[..., Any],
    server_config: Callable[..., Any],
    tiny_model_dir: Path,
    raccoon_requests: list[Any],
    prompt_encoder: Any,
    free_port: Callable[[], int],
) -> None:
    server = start_server(tiny_model_dir, "--engine", "hf")
    cfg = server_config(
        servers=[{"base_url": server.url, "group_port": free_port()}], timeout_s=4.0, infer_timeout_s=None
    )
    backend = connect_backend(cfg, prompt_encoder)
    assert backend.connections[0].infer_timeout_s is None  # no HTTP timeout on /infer/
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(BackendError) as caught:
            backend.generate(raccoon_requests[:1], Decoding(max_new_tokens=4), seed=0)
        elapsed = time.monotonic() - started
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    assert server.url in str(caught.value) and "no answer for 4s" in str(caught.value)
    assert elapsed < 4.0 + 6.0, elapsed  # timeout_s plus one health poll
    print(f"frozen server detected after {elapsed:.1f}s (timeout_s 4)")
    backend.close()


def test_sigterm_stops_a_server_whose_engine_is_wedged(tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_tcp_port()
    log_path = tmp_path / "stuck.log"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [
        sys.executable,
        str(REPO / "tests/server/stuck_server.py"),
        "serve",
        "--model",
        str(tiny_model_dir),
        "--engine",
        "hf",
        "--port",
        str(port),
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{url}/health/", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                time.sleep(0.5)
        body = {"infer_requests": [SWIFT_CHAT], "request_config": {"max_tokens": 2}}
        cut_off: list[requests.RequestException] = []

        def call_in_flight() -> None:  # its server is stopped under it: the call must end, cut off
            try:
                requests.post(f"{url}/infer/", json=body, timeout=60)
            except requests.RequestException as exc:
                cut_off.append(exc)

        caller = threading.Thread(target=call_in_flight, daemon=True)
        caller.start()
        while "wedged" not in log_path.read_text():
            assert time.monotonic() < deadline, log_path.read_text()[-2000:]
            time.sleep(0.2)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=5.0)  # raises TimeoutExpired if the server outlives 5 s
        print(
            f"server with a wedged engine gone {time.monotonic() - started:.1f}s after SIGTERM, rc {process.returncode}"
        )
        caller.join(timeout=10)
        assert not caller.is_alive() and len(cut_off) == 1, cut_off  # the call in flight ended, cut off
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_seed_overflow_no_longer_wedges_vllm_and_sigterm_stops_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    server = launch_server(
        tiny_model_dir, free_tcp_port(), tmp_path / "vllm.log", "--engine", "vllm", "--max-model-len", "1024"
    )
    try:
        for seed in (2**64, -(2**63) - 1, 2**63):
            bad = {
                "infer_requests": [SWIFT_CHAT],
                "request_config": {"max_tokens": 4, "temperature": 1.0, "seed": seed},
            }
            reply = requests.post(f"{server.url}/infer/", json=bad, timeout=30)
            assert reply.status_code == 422 and "request_config.seed" in reply.json()["error"], reply.text
        good = {
            "infer_requests": [SWIFT_CHAT] * 2,
            "request_config": {"max_tokens": 4, "temperature": 1.0, "seed": 2**63 - 2},
        }
        reply = requests.post(
            f"{server.url}/infer/", json=good, timeout=30
        )  # seed + 1 is the last int64: fine
        assert reply.status_code == 200, reply.text
        good["request_config"]["seed"] = 2**63 - 1  # seed + 1 overflows: refused, naming the field
        reply = requests.post(f"{server.url}/infer/", json=good, timeout=30)
        assert reply.status_code == 400 and "request_config.seed" in reply.text
        assert requests.get(f"{server.url}/health/", timeout=10).status_code == 200
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=5.0)
        print(f"vllm server gone {time.monotonic() - started:.1f}s after SIGTERM")
    finally:
        server.stop()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_a_request_that_fails_inside_vllm_leaves_the_engine_clean(
    shared_vllm_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wedge itself, below the wire checks (skipped by fault injection): vLLM raises on the seed and
    keeps the request queued; the server recovers the engine, so the next call is served."""
    from rollmatch.protocol import InferBody, RequestConfig
    from rollmatch.server.rollout_server import RolloutServer

    engine = shared_vllm_engine.get()
    server = RolloutServer(engine)
    clean = False
    try:
        good = InferBody.model_validate({"infer_requests": [SWIFT_CHAT], "request_config": {"max_tokens": 4}})
        prompts = [engine.preparer.prepare(good.infer_requests[0], 0)]
        unchecked = RequestConfig.model_construct(
            **{**RequestConfig().model_dump(), "seed": 2**64, "temperature": 1.0, "max_tokens": 4}
        )
        with monkeypatch.context() as patch:
            patch.setattr(
                server.checks, "check", lambda body, times, cancelled=None, **_: (unchecked, prompts, None)
            )
            with pytest.raises(ValueError, match=r"the engine refused the request .*Overflow"):
                infer_in_process(server, good)
        done: dict[str, Any] = {}
        worker = threading.Thread(
            target=lambda: done.setdefault("out", infer_in_process(server, good)), daemon=True
        )
        worker.start()
        worker.join(timeout=60)  # without the recovery: spins forever holding the engine
        assert "out" in done and done["out"][0].response.choices[0].finish_reason in ("stop", "length")
        assert server.unhealthy() is None
        clean = True
    finally:  # the shared engine stays open, unless this test left it wedged
        server.scheduler.close()
        server.sync.shutdown()
        if not clean:
            shared_vllm_engine.discard()


def test_sync_needs_the_token_and_the_lease_and_keeps_the_version_when_refused(
    start_server: Callable[..., Any],
    server_config: Callable[..., Any],
    tiny_model_dir: Path,
    prompt_encoder: Any,
    free_port: Callable[[], int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = start_server(tiny_model_dir, "--engine", "hf", "--api-key", "k3y")
    model = AutoModelForImageTextToText.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    cfg = server_config(servers=[{"base_url": server.url, "group_port": free_port()}], timeout_s=30)
    monkeypatch.delenv("ROLLMATCH_API_KEY", raising=False)
    with pytest.raises(BackendError, match=r"/info/\) -> HTTP 401: missing API key.*set ROLLMATCH_API_KEY"):
        connect_backend(cfg, prompt_encoder, model)  # /info/ needs the key: start-up fails
    assert server.get("/stats/", api_key="k3y")["weight_version"] == 0
    monkeypatch.setenv("ROLLMATCH_API_KEY", "k3y")
    trainer = connect_backend(cfg, prompt_encoder, model)
    trainer.sync_weights(model, 1)
    assert server.get("/stats/", api_key="k3y")["weight_version"] == 1
    finish = {"version": 2, "mode": "full", "bucket_checksums": [], "checksum": ""}
    for headers in ({}, {"Authorization": "Bearer nope"}):
        reply = requests.post(f"{server.url}/finish_weight_update/", json=finish, headers=headers, timeout=30)
        assert reply.status_code == 401
        reply = requests.post(
            f"{server.url}/init_communicator/",
            json={"host": "127.0.0.1", "port": free_port(), "world_size": 2},
            headers=headers,
            timeout=30,
        )
        assert reply.status_code == 401
    reply = requests.post(
        f"{server.url}/finish_weight_update/",
        json=finish,
        headers={"Authorization": "Bearer k3y"},
        timeout=30,
    )
    assert reply.status_code == 409 and "sync lease" in reply.text  # authenticated, but not the lease holder
    stats = server.get("/stats/", api_key="k3y")
    assert stats["weight_version"] == 1 and stats["communicator"] == "ready"
    trainer.sync_weights(model, 2)  # the lease holder still pushes
    assert server.get("/stats/", api_key="k3y")["weight_version"] == 2
    other = connect_backend(cfg, prompt_encoder, model)
    other.sync_weights(model, 3)  # a restarted trainer takes the group over...
    with pytest.raises(SyncError, match="sync lease"):
        trainer.pusher._push_mode(
            model, 4, "full", trainer.connections
        )  # ...and the previous holder is refused with the reason
    assert server.get("/stats/", api_key="k3y")["weight_version"] == 3
    for backend in (trainer, other):
        backend.close()
