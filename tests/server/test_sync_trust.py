"""Who may administer weight sync: the sync key for ``/init_communicator/``, the lease for every bucket,
finish and close, and the digest key that comes with the lease (the real app in process, then a
real ``rollmatch serve`` with an API key and a sync key, pushed to by a real trainer over gloo)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests

from rollmatch.errors import BackendError, ConfigError
from rollmatch.protocol import API_KEY_ENV, LEASE_HEADER, SYNC_KEY_ENV, SYNC_KEY_HEADER
from rollmatch.server.gate import server_sync_key

API_KEY, SYNC_KEY = "generation-key", "weight-admin-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _init(client: Any, port: int, headers: dict[str, str], **extra: Any) -> Any:
    body = {"host": "127.0.0.1", "port": port, "world_size": 2, "timeout_s": 3600.0, **extra}
    return client.post("/init_communicator/", json=body, headers=headers)


def test_an_api_key_holder_without_the_sync_key_cannot_form_the_group(
    hf_engine: Any, app_client: Callable[..., Any], free_port: Callable[[], int]
) -> None:
    client, server = app_client(hf_engine, api_key=API_KEY, sync_key=SYNC_KEY)
    for extra in ({}, {SYNC_KEY_HEADER: "guess"}, {SYNC_KEY_HEADER: API_KEY}):
        reply = _init(client, free_port(), {**AUTH, **extra})
        assert reply.status_code == 403, reply.text
        assert "sync key" in reply.text and "guess" not in reply.text
    assert server.stats().communicator == "none"
    assert (
        client.post("/infer/", json={"infer_requests": []}, headers=AUTH).status_code == 200
    )  # generation stays
    reply = _init(client, free_port(), {**AUTH, SYNC_KEY_HEADER: SYNC_KEY})
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert len(answer["lease"]) == 32 and len(answer["digest_key"]) == 64
    assert server.stats().communicator == "initializing"
    headers = {**AUTH, LEASE_HEADER: answer["lease"]}
    assert client.post("/close_communicator/", headers=headers).status_code == 200


def test_the_trainers_digest_key_is_used_and_a_malformed_one_is_a_422(
    hf_engine: Any, app_client: Callable[..., Any], free_port: Callable[[], int]
) -> None:
    client, _ = app_client(hf_engine)
    key = "ab" * 32
    answer = _init(client, free_port(), {}, digest_key=key).json()
    assert answer["digest_key"] == key
    client.post("/close_communicator/", headers={LEASE_HEADER: answer["lease"]})
    for bad in ("ab" * 31, "zz" * 32, "AB" * 32):
        reply = _init(client, free_port(), {}, digest_key=bad)
        assert reply.status_code == 422 and bad not in reply.text


def test_close_needs_the_lease_while_one_is_held_and_is_idempotent(
    hf_engine: Any, app_client: Callable[..., Any], free_port: Callable[[], int]
) -> None:
    client, server = app_client(hf_engine)
    assert client.post("/close_communicator/").status_code == 200  # nothing held: a no-op (swift's close)
    lease = _init(client, free_port(), {}).json()["lease"]
    for headers in ({}, {LEASE_HEADER: "f" * 32}):  # an API-key holder without the lease
        reply = client.post("/close_communicator/", headers=headers)
        assert reply.status_code == 409 and "sync lease" in reply.text, reply.text
    assert server.stats().communicator == "initializing"  # the trainer's pending group survived
    reply = client.post("/close_communicator/", headers={LEASE_HEADER: lease})
    assert reply.status_code == 200 and reply.json()["message"] == "communicator closed"
    assert server.stats().communicator == "none"
    reply = client.post("/close_communicator/", headers={LEASE_HEADER: lease})  # sent twice: still fine
    assert reply.status_code == 200 and reply.json()["message"] == "no communicator to close"


def test_a_sync_key_equal_to_the_api_key_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="equals the API key"):
        server_sync_key(API_KEY, None, {}, API_KEY)
    key_file = tmp_path / "sync_key"
    key_file.write_text(SYNC_KEY + "\n")
    assert server_sync_key(None, str(key_file), {}, API_KEY) == SYNC_KEY
    assert server_sync_key(None, None, {SYNC_KEY_ENV: SYNC_KEY}, API_KEY) == SYNC_KEY
    assert server_sync_key(None, None, {}, API_KEY) is None


@pytest.mark.heavy
def test_a_real_server_takes_weights_only_from_the_sync_key_holder(
    start_server: Callable[..., Any],
    tiny_model_dir: Path,
    trainer_side: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    key_file = tmp_path / "sync_key"
    key_file.write_text(SYNC_KEY)
    server = start_server(
        tiny_model_dir, "--engine", "hf", "--api-key", API_KEY, "--sync-key-file", str(key_file)
    )
    monkeypatch.setenv(API_KEY_ENV, API_KEY)
    monkeypatch.delenv(SYNC_KEY_ENV, raising=False)
    generation_only = trainer_side(server.url)  # holds the API key only: generates, cannot push
    with pytest.raises(BackendError, match=rf"HTTP 403: missing sync key.*set {SYNC_KEY_ENV}"):
        generation_only.backend.sync_weights(generation_only.model, 1)
    assert server.get("/stats/", api_key=API_KEY)["communicator"] == "none"

    monkeypatch.setenv(SYNC_KEY_ENV, SYNC_KEY)
    side = trainer_side(server.url)
    report = side.backend.sync_weights(side.model, 1)
    assert report.version == 1 and server.get("/info/", api_key=API_KEY)["weight_version"] == 1
    reply = requests.post(f"{server.url}/close_communicator/", headers=AUTH, timeout=30)  # no lease
    assert reply.status_code == 409
    assert side.backend.sync_weights(side.model, 2).version == 2  # the trainer's group is intact
