"""Typed weight-push failures against real ``rollmatch serve`` processes (``rollout.weight_push``,
``sync.transaction``, :class:`~rollmatch.errors.ServerPushFailed`).

- a push that fails at one server is attributed to that server by type (its URL and the phase), not
  by the URLs its error text happens to quote: that server is dropped and the push goes on to the rest;
- a server killed in the middle of a push fails it with the server's URL and the phase it died in;
- a server that refuses an update (its sync lease was taken over) fails it the same way, as a refusal.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_backends import connect_backend, two_hf_servers_backend
from transformers import AutoModelForImageTextToText

from rollmatch.errors import BackendError, ServerDown, ServerPushFailed, SyncError

pytestmark = pytest.mark.heavy
SMALL_BUCKETS = 256 << 10  # the tiny model's ~3.5 MB in many buckets: a kill can land between two


def _record_failures(backend: Any, monkeypatch: pytest.MonkeyPatch) -> list[BaseException]:
    """Every failure the push failover attributes (a spy: the failover's own code still decides)."""
    seen: list[BaseException] = []
    attribute = backend.pusher._failed_servers

    def recorded(exc: BaseException, targets: list[Any]) -> list[Any]:
        seen.append(exc)
        return attribute(exc, targets)

    monkeypatch.setattr(backend.pusher, "_failed_servers", recorded)
    return seen


def test_a_push_failure_is_the_failing_servers_by_type_and_a_server_killed_mid_push_is_named(
    start_server: Callable[..., Any],
    server_config: Callable[..., Any],
    tiny_model_dir: Path,
    prompt_encoder: Any,
    free_port: Callable[[], int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first, second, model, backend = two_hf_servers_backend(
        start_server, server_config, tiny_model_dir, prompt_encoder, free_port
    )
    failures = _record_failures(backend, monkeypatch)
    first_conn, second_conn = backend.connections
    try:
        assert backend.sync_weights(model, 1).servers == (first.url, second.url)

        # The first server fails an announcement with a message that quotes only the second's URL
        # (fault injected: say, a proxy's error). The failure is the first server's: it is dropped.
        post = first_conn.post

        def misleading_failure(path: str, body: Any, phase: str, timeout_s: Any = None) -> Any:
            if path == "/update_flattened_params/":
                raise BackendError(f"upstream {second.url} answered HTTP 502 (injected)")
            return post(path, body, phase) if timeout_s is None else post(path, body, phase, timeout_s)

        monkeypatch.setattr(first_conn, "post", misleading_failure)
        assert backend.sync_weights(model, 2).servers == (second.url,)  # went on without the first
        assert [(type(f), f.url, f.phase) for f in failures] == [(ServerPushFailed, first.url, "announce")]  # type: ignore[attr-defined]
        assert backend.pool.is_down(first_conn) and not backend.pool.is_down(second_conn)
        assert second.get("/info/")["weight_version"] == 2 and first.get("/info/")["weight_version"] == 1
        monkeypatch.setattr(first_conn, "post", post)

        # The second server, now the only one pushed to (the first's re-sync backs off), is SIGKILLed
        # before its second bucket is announced: the push fails naming it and the phase.
        backend.pusher.bucket_bytes = SMALL_BUCKETS
        second_post, announced = second_conn.post, []

        def kill_before_second_bucket(path: str, body: Any, phase: str, timeout_s: Any = None) -> Any:
            if path == "/update_flattened_params/":
                announced.append(phase)
                if len(announced) == 2:
                    second.process.send_signal(signal.SIGKILL)
                    second.process.wait(timeout=30)
            if timeout_s is None:
                return second_post(path, body, phase)
            return second_post(path, body, phase, timeout_s)

        monkeypatch.setattr(second_conn, "post", kill_before_second_bucket)
        failures.clear()
        with pytest.raises(ServerPushFailed) as raised:
            backend.sync_weights(model, 3)
        assert (raised.value.url, raised.value.phase) == (second.url, "announce")
        assert isinstance(raised.value.cause, ServerDown) and not raised.value.refused
        assert str(raised.value).startswith(
            f"rollout server {second.url}: announcing a bucket failed: ServerDown"
        )
        assert [f.url for f in failures] == [second.url]  # type: ignore[attr-defined]
        assert len(announced) == 2 and backend.weight_version == 2  # the failed version is not served
    finally:
        backend.close()


def test_a_server_that_refuses_the_update_fails_the_push_with_its_url(
    start_server: Callable[..., Any],
    server_config: Callable[..., Any],
    tiny_model_dir: Path,
    prompt_encoder: Any,
    free_port: Callable[[], int],
) -> None:
    """A second trainer takes the server's weight-sync group over; the first trainer's next push is
    refused (409: not the lease holder) at its first announcement, and the server keeps its version."""
    server = start_server(tiny_model_dir, "--engine", "hf")
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = server_config(servers=[{"base_url": server.url, "group_port": free_port()}], timeout_s=20.0)
    trainer = connect_backend(cfg, prompt_encoder, model)
    other = connect_backend(cfg, prompt_encoder, model)
    try:
        trainer.sync_weights(model, 1)
        other.sync_weights(model, 2)  # a restarted trainer takes the group over
        with pytest.raises(ServerPushFailed) as raised:
            trainer.sync_weights(model, 3)
        assert (raised.value.url, raised.value.phase) == (server.url, "announce")
        assert isinstance(raised.value.cause, SyncError) and raised.value.refused
        assert "sync lease" in str(raised.value)
        assert server.get("/info/")["weight_version"] == 2
    finally:
        for backend in (trainer, other):
            backend.close()
