"""Weight-sync security in process (the real app, a real gloo group): lease, loopback-only group,
bounded timeouts, cancellable init, and abandoned updates that are logged, counted and freed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from rollmatch.sync.transport import GroupTransport

LEASE = "X-Rollmatch-Sync-Lease"


def _init(client: Any, port: int, **extra: Any) -> Any:
    body = {"host": "127.0.0.1", "port": port, "world_size": 2, "timeout_s": 5.0, **extra}
    return client.post("/init_communicator/", json=body)


def _listeners(port: int) -> list[str]:
    """Local addresses listening on ``port`` (from /proc/net/tcp: state 0A = LISTEN)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                found.append(address)
    return found


def test_group_listens_on_loopback_only_and_bad_inits_are_refused(
    hf_engine: Any, app_client: Callable[..., Any], free_port: Callable[[], int]
) -> None:
    client, server = app_client(hf_engine)
    port = free_port()
    reply = _init(client, port)
    assert reply.status_code == 200 and len(reply.json()["lease"]) == 32
    assert _listeners(port) == ["0100007F"]  # 127.0.0.1 only, not 0.0.0.0 / ::
    assert server.stats().communicator == "initializing"
    reply = _init(client, free_port(), host="0.0.0.0")
    assert reply.status_code == 409 and "all interfaces" in reply.text
    reply = _init(client, free_port(), timeout_s=1e20)
    assert reply.status_code == 422 and "timeout_s" in reply.json()["error"]


def test_close_cancels_a_pending_init_and_frees_its_port(
    hf_engine: Any, app_client: Callable[..., Any], free_port: Callable[[], int]
) -> None:
    client, server = app_client(hf_engine)
    port = free_port()
    lease = _init(client, port, timeout_s=3600).json()["lease"]  # nobody will join
    started = time.monotonic()
    assert client.post("/close_communicator/", headers={LEASE: lease}).status_code == 200
    assert time.monotonic() - started < 3 and server.stats().communicator == "none"
    assert _listeners(port) == []
    assert _init(client, port, timeout_s=3600).status_code == 200  # the port is free again
    lease = _init(client, port, timeout_s=3600).json()["lease"]  # a new init replaces a pending one
    client.post("/close_communicator/", headers={LEASE: lease})


def _join_and_send(port: int, payload: torch.Tensor) -> GroupTransport:
    trainer = GroupTransport(host="127.0.0.1", port=port, rank=1, world_size=2, timeout_s=5)
    trainer.broadcast(payload, src=1, phase="test bucket")
    return trainer


def test_only_the_lease_holder_pushes_and_abandoned_updates_are_freed(
    hf_engine: Any,
    app_client: Callable[..., Any],
    free_port: Callable[[], int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    client, server = app_client(hf_engine)
    port = free_port()
    lease = _init(client, port, timeout_s=2.0).json()["lease"]
    joined: dict[str, Any] = {}
    payload = torch.arange(16, dtype=torch.uint8)
    meta = {
        "name": "lm_head.weight",
        "shape": [4],
        "dtype": "float32",
        "start_idx": 0,
        "end_idx": 16,
        "numel": 4,
    }
    body = {
        "metadatas": [meta],
        "transaction": {"version": 1, "mode": "full", "bucket_index": 0, "num_bytes": 16},
    }
    sender = threading.Thread(
        target=lambda: joined.setdefault("t", _join_and_send(port, payload)), daemon=True
    )
    sender.start()
    for headers in ({}, {LEASE: "f" * 32}):  # no lease / another trainer's lease: refused, nothing staged
        reply = client.post("/update_flattened_params/", json=body, headers=headers)
        assert reply.status_code == 409 and "sync lease" in reply.text
    reply = client.post("/update_flattened_params/", json=body, headers={LEASE: lease})
    assert reply.status_code == 200, reply.text
    sender.join(timeout=10)
    finish = {"version": 1, "mode": "full", "bucket_checksums": ["x"], "checksum": "y"}
    assert client.post("/finish_weight_update/", json=finish).status_code == 409  # no lease
    with caplog.at_level("WARNING", logger="rollmatch.server.sync_session"):
        deadline = time.monotonic() + 10  # the sender never finishes: abandoned after timeout_s (2 s)
        while server.stats().abandoned_pushes == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
    stats = server.stats()
    assert stats.abandoned_pushes == 1 and stats.failed_pushes == 1 and stats.weight_version == 0
    assert "weight update of version 1 (full) abandoned after bucket 0" in caplog.text
    assert server.sync._receiver is not None and server.sync._receiver.staged is None  # buckets freed
    client.post("/close_communicator/", headers={LEASE: lease})
    joined["t"].close()
