"""Failover between real ``rollmatch serve`` processes (``vllm.server.min_healthy``, ``rollout.server_pool``).

- a SIGKILLed server is dropped, its chunk re-sent once to the other server, every rollout returned once
  in request order; restarted on the same port it is not used before a push, the next push re-syncs
  it (fresh groups, full weights) and it serves again at the learner's version;
- a server whose engine stalls is detected through ``/health/`` (503) and treated the same way; with
  the default ``min_healthy`` (every server) the same stall fails the call naming the server.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from server_processes import REPO, launch_server
from trainer_backends import connect_backend, two_hf_servers_backend
from transformers import AutoModelForImageTextToText

from rollmatch.errors import BackendError
from rollmatch.rollout import server_pool
from rollmatch.rollout.types import Decoding

pytestmark = pytest.mark.heavy
DECODING = Decoding(max_new_tokens=4)


def _servers_of(rollouts: list[Any]) -> list[str]:
    return [r.provenance.server for r in rollouts]


def test_a_killed_server_is_dropped_resent_and_rejoins_after_the_next_push(
    start_server: Callable[..., Any],
    server_config: Callable[..., Any],
    tiny_model_dir: Path,
    raccoon_requests: list[Any],
    prompt_encoder: Any,
    free_port: Callable[[], int],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(server_pool, "_PROBE_EVERY_S", 0.0)  # ask the down server at every call
    first, second, model, backend = two_hf_servers_backend(
        start_server, server_config, tiny_model_dir, prompt_encoder, free_port
    )
    requests = raccoon_requests[:3]
    ids = [r.sample_id for r in requests]
    try:
        backend.sync_weights(model, 1)
        assert _servers_of(backend.generate(requests, DECODING, seed=0)) == [first.url] * 2 + [second.url]
        assert backend.take_server_sums() == {"servers/calls": 1, "servers/healthy_sum": 2}

        second.process.send_signal(signal.SIGKILL)
        second.process.wait(timeout=30)
        rollouts = backend.generate(requests, DECODING, seed=0)
        assert [r.sample_id for r in rollouts] == ids  # each request once, in order
        assert _servers_of(rollouts) == [first.url] * 3 and {r.weight_version for r in rollouts} == {1}
        sums = backend.take_server_sums()
        assert (sums["servers/failovers"], sums["servers/resent_calls"]) == (1, 1), sums
        assert _servers_of(backend.generate(requests, DECODING, seed=0)) == [first.url] * 3
        assert backend.take_server_sums()["servers/failovers"] == 0  # down: not tried again

        restarted = launch_server(tiny_model_dir, second.port, tmp_path / "restarted.log", "--engine", "hf")
        try:
            assert restarted.get("/info/")["weight_version"] == 0  # the model directory's weights
            # it answers /health/, but nothing was pushed to it: not used
            assert _servers_of(backend.generate(requests, DECODING, seed=0)) == [first.url] * 3
            report = backend.sync_weights(model, 2)  # re-initialises its group and sends it every tensor
            assert report.servers == (first.url, second.url)
            assert restarted.get("/info/")["weight_version"] == 2 == first.get("/info/")["weight_version"]
            rollouts = backend.generate(requests, DECODING, seed=0)
            assert _servers_of(rollouts) == [first.url] * 2 + [second.url]
            assert {r.weight_version for r in rollouts} == {2}
        finally:
            restarted.stop()
    finally:
        backend.close()


def test_a_stalled_engine_is_detected_by_health_and_its_calls_resent(
    start_server: Callable[..., Any],
    server_config: Callable[..., Any],
    tiny_model_dir: Path,
    raccoon_requests: list[Any],
    prompt_encoder: Any,
    free_port: Callable[[], int],
    tmp_path: Path,
) -> None:
    healthy = start_server(tiny_model_dir, "--engine", "hf")
    # The real server process with an engine that never returns from its step (tests/server/stuck_server.py).
    stuck = launch_server(
        tiny_model_dir,
        free_port(),
        tmp_path / "stuck.log",
        "--engine",
        "hf",
        "--engine-stall-timeout-s",
        "2",
        command=[sys.executable, str(REPO / "tests/server/stuck_server.py")],
    )
    servers = [{"base_url": s.url, "group_port": free_port()} for s in (healthy, stuck)]
    requests = raccoon_requests[:2]
    try:
        backend = connect_backend(
            server_config(servers=servers, timeout_s=30.0, min_healthy=1), prompt_encoder
        )
        strict = connect_backend(server_config(servers=servers, timeout_s=30.0), prompt_encoder)
        rollouts = backend.generate(requests, DECODING, seed=0)  # /infer/ has no HTTP timeout: /health/ tells
        assert _servers_of(rollouts) == [healthy.url] * 2
        assert [r.sample_id for r in rollouts] == [r.sample_id for r in requests]
        assert backend.take_server_sums()["servers/resent_calls"] == 1
        backend.close()

        with pytest.raises(BackendError) as caught:
            strict.generate(requests, DECODING, seed=0)
        message = str(caught.value)
        assert stuck.url in message and "min_healthy" in message and "HTTP 503" in message, message
        strict.close()
    finally:
        stuck.stop()


def test_a_server_that_cannot_form_its_group_is_dropped_for_every_client_and_readmitted_once_it_can(
    start_server: Callable[..., Any],
    server_config: Callable[..., Any],
    tiny_model_dir: Path,
    raccoon_requests: list[Any],
    prompt_encoder: Any,
    free_port: Callable[[], int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second server answers ``/health/`` but its group cannot form (fault injected: its
    ``/init_communicator/`` fails with an error naming only ``host:group_port``, as a group error does).
    The failure is attributed to that server (typed, not from the text), the push goes on to the first,
    the server is dropped by the learner *and* by an async actor's client, re-sync attempts back off, and
    once its group can form again the next due push re-admits it everywhere."""
    from rollmatch.training.variants import ActorRolloutClient

    first, second = (
        start_server(tiny_model_dir, "--engine", "hf"),
        start_server(tiny_model_dir, "--engine", "hf"),
    )
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32)
    group_port = free_port()
    cfg = server_config(
        servers=[
            {"base_url": first.url, "group_port": free_port()},
            {"base_url": second.url, "group_port": group_port},
        ],
        timeout_s=20.0,
        min_healthy=1,
    )
    backend = connect_backend(cfg, prompt_encoder, model)
    actor = ActorRolloutClient(backend)  # built as the async variant builds each rank's actor client
    broken, inits = True, []
    conn = backend.connections[1]
    post = conn.post

    def post_or_fail(path: str, body: Any, phase: str, timeout_s: Any = None) -> Any:
        if path == "/init_communicator/":
            inits.append(broken)
            if broken:
                raise ConnectionError(f"TCPStore at 127.0.0.1:{group_port}: connection refused")
        return post(path, body, phase) if timeout_s is None else post(path, body, phase, timeout_s)

    monkeypatch.setattr(conn, "post", post_or_fail)
    requests = raccoon_requests[:3]
    try:
        report = backend.sync_weights(model, 1)
        assert report.servers == (first.url,)  # the push went on without it
        assert backend.pool.is_down(conn) and actor._client.pool.is_down(actor._client.connections[1])
        assert backend.take_server_sums()["servers/failovers"] == 1
        assert actor.take_server_sums()["servers/failovers"] == 0  # one death, counted once
        assert _servers_of(actor.generate(requests, DECODING, seed=0)) == [first.url] * 3
        assert backend.sync_weights(model, 2).servers == (first.url,)
        assert inits == [True]  # push 2 skipped its re-sync (back-off): no failed attempt, no second push
        broken = False  # its group can form again
        assert backend.sync_weights(model, 3).servers == (first.url, second.url)
        assert inits[-1] is False and second.get("/info/")["weight_version"] == 3
        rollouts = actor.generate(requests, DECODING, seed=0)
        assert _servers_of(rollouts) == [first.url] * 2 + [second.url]  # chunk i to server i again
        assert {r.weight_version for r in rollouts} == {3}
    finally:
        actor.close()
        backend.close()


def test_a_server_an_actor_found_down_is_left_out_of_the_next_push_and_readmitted_when_back(
    start_server: Callable[..., Any],
    server_config: Callable[..., Any],
    tiny_model_dir: Path,
    raccoon_requests: list[Any],
    prompt_encoder: Any,
    free_port: Callable[[], int],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second server is SIGKILLed; an async actor's client finds it down on a rollout call. The
    learner's next push knows it from the actor (not from a failed push): it goes to the first server
    alone in one attempt, and the failover is counted once (by the actor). Restarted on its port, the server
    answers ``/health/`` again: the push after that re-syncs it and every client uses it again."""
    from rollmatch.training.variants import ActorRolloutClient

    first, second, model, backend = two_hf_servers_backend(
        start_server, server_config, tiny_model_dir, prompt_encoder, free_port
    )
    actor = ActorRolloutClient(backend)  # built as the async variant builds each rank's actor client
    attempts: list[list[str]] = []
    push_to = backend.pusher._push_to

    def recorded_push_to(model: Any, version: int, targets: list[Any]) -> Any:
        attempts.append([c.url for c in targets])
        return push_to(model, version, targets)

    monkeypatch.setattr(backend.pusher, "_push_to", recorded_push_to)
    requests = raccoon_requests[:3]
    try:
        assert backend.sync_weights(model, 1).servers == (first.url, second.url)
        second.process.send_signal(signal.SIGKILL)
        second.process.wait(timeout=30)
        assert _servers_of(actor.generate(requests, DECODING, seed=0)) == [first.url] * 3  # re-sent
        assert actor.take_server_sums()["servers/failovers"] == 1
        assert not backend.pool.is_down(backend.connections[1])  # the learner's own calls never failed

        attempts.clear()
        assert backend.sync_weights(model, 2).servers == (first.url,)
        assert attempts == [[first.url]]  # not pushed to: no failed attempt, no second push
        assert backend.pool.is_down(backend.connections[1])
        assert backend.take_server_sums()["servers/failovers"] == 0  # one death, counted once (the actor)

        restarted = launch_server(tiny_model_dir, second.port, tmp_path / "restarted.log", "--engine", "hf")
        try:
            assert backend.sync_weights(model, 3).servers == (first.url, second.url)  # answers: re-synced
            assert restarted.get("/info/")["weight_version"] == 3
            rollouts = actor.generate(requests, DECODING, seed=0)
            assert _servers_of(rollouts) == [first.url] * 2 + [second.url]  # chunk i to server i again
            assert {r.weight_version for r in rollouts} == {3}
        finally:
            restarted.stop()
    finally:
        actor.close()
        backend.close()
