"""Weight-sync groups: a real TCPStore + gloo group (ranks played by threads) and the in-process one."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
from local_ports import free_tcp_port

from rollmatch.errors import CollectiveTimeoutError
from rollmatch.sync.transport import GroupTransport, LocalTransport, default_backend


def _in_thread(fn: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def test_gloo_group_broadcasts_from_the_last_rank_and_reforms_on_the_same_port() -> None:
    port = free_tcp_port()
    payload = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    for round_ in range(2):  # the second round reuses the port after close()
        received = torch.zeros_like(payload)

        def server(target: torch.Tensor = received) -> None:
            group = GroupTransport(host="127.0.0.1", port=port, rank=0, world_size=2, timeout_s=20)
            group.broadcast_async(target, src=1).wait("test receive")
            group.close()

        thread, errors = _in_thread(server)
        client = GroupTransport(host="127.0.0.1", port=port, rank=1, world_size=2, timeout_s=20)
        client.broadcast(payload + round_, src=1, phase="test send")
        thread.join(timeout=30)
        client.close()
        client.close()  # idempotent
        assert not errors and not thread.is_alive()
        assert torch.equal(received, payload + round_)


def test_group_rendezvous_times_out_naming_the_address() -> None:
    port = free_tcp_port()
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=rf"127.0.0.1:{port} \(gloo, rank 1/2\) within 1s"):
        GroupTransport(host="127.0.0.1", port=port, rank=1, world_size=2, timeout_s=1)
    assert time.monotonic() - start < 15


def test_a_broadcast_nobody_sends_times_out_naming_the_phase() -> None:
    port = free_tcp_port()
    joined = threading.Event()
    release = threading.Event()

    def client() -> None:  # joins, then never sends
        group = GroupTransport(host="127.0.0.1", port=port, rank=1, world_size=2, timeout_s=2)
        joined.set()
        release.wait(timeout=30)
        group.close()

    thread, _ = _in_thread(client)
    server = GroupTransport(host="127.0.0.1", port=port, rank=0, world_size=2, timeout_s=2)
    assert joined.wait(timeout=30)
    buffer = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(CollectiveTimeoutError, match=r"'receive bucket 0'.*timed out after 2s"):
        server.broadcast_async(buffer, src=1).wait("receive bucket 0")
    release.set()
    thread.join(timeout=30)
    server.close()


def test_local_transport_has_the_same_semantics() -> None:
    receiver, sender = LocalTransport.group(2, timeout_s=1)
    target = torch.zeros(4)
    pending = receiver.broadcast_async(target, src=1)
    sender.broadcast(torch.arange(4.0), src=1, phase="send")
    pending.wait("receive")
    assert target.tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(CollectiveTimeoutError, match="'nothing sent' timed out"):
        receiver.broadcast(target, src=1, phase="nothing sent")
    sender.broadcast(torch.zeros(3), src=1, phase="send")
    with pytest.raises(CollectiveTimeoutError, match="receiver expected"):
        receiver.broadcast(target, src=1, phase="wrong shape")


def test_default_backend_follows_the_device() -> None:
    assert default_backend("cpu") == "gloo"
    assert default_backend(torch.device("cuda", 0)) == "nccl"
