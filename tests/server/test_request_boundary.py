"""The rollout server's request boundary: what a request may cost before it is refused.

Each test names the failure the former code had. In process (the real app on the real HF engine,
driven over httpx) unless a socket-level property needs a real ``rollmatch serve`` process.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from PIL import Image

from rollmatch.protocol import encode_image
from rollmatch.server import adversarial
from rollmatch.server.limits import RequestTooLarge, ServerLimits, count_infer_requests, json_value_bound

LEASE = "X-Rollmatch-Sync-Lease"
JSON = {"content-type": "application/json"}


def _png(size: tuple[int, int] = (28, 28)) -> str:
    return encode_image(Image.new("RGB", size, (200, 30, 30)))


def _chat(images: list[str] | None = None) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "<image>find"}],
        "images": [_png()] if images is None else images,
    }


def _lease(client: Any, port: int) -> dict[str, str]:
    init = {"host": "127.0.0.1", "port": port, "world_size": 2, "timeout_s": 3600.0}
    reply = client.post("/init_communicator/", json=init)
    assert reply.status_code == 200, reply.text
    return {LEASE: reply.json()["lease"]}


# ----------------------------------------------------------------------------- JSON value count
def test_the_value_cap_costs_milliseconds_on_any_body(hf_engine: Any, app_client: Callable[..., Any]) -> None:
    """The former count's pattern rescanned unterminated ``\\"`` escapes from every quote: 16,000
    took 5.7 s, a 1 MiB body 8.1 s, holding the GIL (every thread of the server stopped)."""
    limits = ServerLimits()
    for body in (
        adversarial.redos_escapes(16_000),
        adversarial.redos_escapes(1 << 20),
        adversarial.redos_escapes_then_brackets(300, 1 << 20),
        adversarial.many_prompt_ids(8 << 20),
    ):
        started = time.monotonic()
        with contextlib.suppress(RequestTooLarge):  # refused or not: decided in milliseconds
            limits.check_json_values(body)
        assert time.monotonic() - started < 0.5, len(body)
    client, _ = app_client(hf_engine, max_tokens=2)
    for body in (adversarial.redos_escapes(16_000), adversarial.redos_escapes_then_brackets(300, 1 << 20)):
        started = time.monotonic()
        reply = client.post("/infer/", content=body, headers=JSON)
        assert 400 <= reply.status_code < 500 and time.monotonic() - started < 2.0, reply.text[:200]


def test_prompt_ids_count_against_the_value_cap(hf_engine: Any, app_client: Callable[..., Any]) -> None:
    """Numbers were not counted: 8 MiB of prompt ids passed the cap (8 values) and cost +84 MiB."""
    assert json_value_bound(b'{"prompt_token_ids":[1,2,3,4]}') == 6  # object, key, array, 3 commas
    client, server = app_client(hf_engine, max_tokens=2)
    reply = client.post("/infer/", content=adversarial.many_prompt_ids(8 << 20), headers=JSON)
    assert reply.status_code == 413 and "--max-json-values" in reply.text, reply.text[:300]
    assert server.stats().rejected_requests == 1


# ---------------------------------------------------------------------------- request count
def test_the_request_count_is_bounded_before_the_body_is_parsed(
    hf_engine: Any, app_client: Callable[..., Any]
) -> None:
    """163k tiny requests in 8 MB: the parser built them all (2.2 s, +273 MB) before a 422 from the
    wire's 4,096 bound; now the server's own cap answers 413 from a scan of the raw body."""
    client, _ = app_client(
        hf_engine, max_tokens=2, max_json_values=1 << 23, max_json_keys=1 << 23
    )  # this cap alone
    body = adversarial.many_tiny_requests(8 << 20)
    started = time.monotonic()
    reply = client.post("/infer/", content=body, headers=JSON)
    assert reply.status_code == 413 and "--max-requests-per-call" in reply.text, reply.text[:300]
    assert time.monotonic() - started < 2.0
    # Only the items of the top-level infer_requests array count (escaped keys decoded).
    assert count_infer_requests(b'{"infer\\u005frequests":[{},{"a":[{}]},{}]}') == 3
    assert count_infer_requests(b'{"metrics":{"infer_requests":[{},{}]},"infer_requests":[]}') == 0
    assert count_infer_requests(b'{"infer_requests":[{"messages":"{{{"}]}') == 1


def test_an_over_long_prompt_is_refused_before_its_images_are_read(
    hf_engine: Any, app_client: Callable[..., Any]
) -> None:
    """Formerly every image's header was read (and each decoded) before the length check: this body
    got the image's error instead."""
    client, _ = app_client(hf_engine, max_tokens=2)
    ids = [5] * 2000  # over the engine's max_model_len of 1024
    reply = client.post("/infer/", json={"infer_requests": [{"prompt_token_ids": ids, "images": ["!!"]}]})
    assert reply.status_code == 400 and "prompt too long" in reply.text, reply.text


# ------------------------------------------------------------------------------- admission
def test_a_full_server_refuses_right_after_the_parse(
    hf_engine: Any, app_client: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Admission was decided after every image was decoded: a full server answered this call's bad
    image (400) instead of 429, having done all the work."""
    client, server = app_client(hf_engine, max_tokens=2, max_requests_per_call=1, max_queued_prompts=1)
    release = threading.Event()
    monkeypatch.setattr(hf_engine, "step", lambda: release.wait(30) and [])  # the engine holds the first call
    first: list[Any] = []
    waiting = threading.Thread(
        target=lambda: first.append(client.post("/infer/", json={"infer_requests": [_chat()]}))
    )
    waiting.start()
    try:
        deadline = time.monotonic() + 10
        while server.scheduler.depth()["outstanding_prompts"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        reply = client.post("/infer/", json={"infer_requests": [_chat(["not an image"])]})
        assert reply.status_code == 429 and "--max-queued-prompts" in reply.text, reply.text
        assert reply.headers["retry-after"] == "1"
    finally:
        release.set()
        monkeypatch.undo()
        waiting.join(timeout=30)
    assert first and first[0].status_code == 200, first


# ----------------------------------------------------------------------------------- bodies
def test_the_body_is_dropped_once_prepared_and_in_flight_bodies_are_bounded(
    hf_engine: Any, app_client: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The raw body was held for the whole engine wait, with no bound on body bytes in flight."""
    client, server = app_client(
        hf_engine, max_tokens=2, max_body_bytes=1 << 20, max_inflight_body_bytes=1 << 20
    )
    release = threading.Event()
    monkeypatch.setattr(hf_engine, "step", lambda: release.wait(30) and [])
    replies: list[Any] = []
    waiting = threading.Thread(
        target=lambda: replies.append(client.post("/infer/", json={"infer_requests": [_chat()]}))
    )
    waiting.start()
    try:
        deadline = time.monotonic() + 10
        while server.scheduler.depth()["outstanding_prompts"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.pixels.held > 0 and server.bodies.held == 0  # waiting on the engine without its body
        lease = server.bodies.lease()
        lease.grow(900_000)  # bodies being received or parsed hold the budget
        reply = client.post("/infer/", content=b"{" + b" " * 200_000 + b"}", headers=JSON)
        assert reply.status_code == 429 and "--max-inflight-body-bytes" in reply.text, reply.text
        lease.release()
        assert server.bodies.held == 0
    finally:
        release.set()
        monkeypatch.undo()
        waiting.join(timeout=30)
    assert replies and replies[0].status_code == 200
    with pytest.raises(ValueError, match="--max-inflight-body-bytes 1000 is below --max-body-bytes"):
        ServerLimits(max_body_bytes=2000, max_inflight_body_bytes=1000)


def test_an_image_far_larger_than_its_pixels_is_refused(
    hf_engine: Any, app_client: Callable[..., Any]
) -> None:
    """A 1x1 PNG padded with trailing bytes cost one pixel of the pixel budget and was served."""
    client, _ = app_client(hf_engine, max_tokens=2)
    reply = client.post("/infer/", content=adversarial.padded_png(1 << 20), headers=JSON)
    assert reply.status_code == 413 and "bytes per pixel" in reply.text, reply.text[:300]
    honest = _png((64, 64))  # a real image stays well within the ratio
    assert client.post("/infer/", json={"infer_requests": [_chat([honest])]}).status_code == 200


def test_base64_is_decoded_once_per_image(
    hf_engine: Any, app_client: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The header check and the decoding each decoded the base64 (twice per image)."""
    from rollmatch.server import media

    decoded: list[int] = []
    real = media.from_base64
    monkeypatch.setattr(media, "from_base64", lambda text: decoded.append(len(text)) or real(text))
    client, _ = app_client(hf_engine, max_tokens=2)
    reply = client.post("/infer/", json={"infer_requests": [_chat(), _chat([_png((40, 30))])]})
    assert reply.status_code == 200, reply.text
    assert len(decoded) == 2, decoded


# ------------------------------------------------------------------------------ weight sync
def test_sync_bodies_are_capped_after_the_lease(
    hf_engine: Any, app_client: Callable[..., Any], free_port: Callable[[], int]
) -> None:
    """Sync bodies were parsed on the event loop, before the lease and without a value cap
    (8 MiB of ``[]`` in ``peft_config``: 1.2 s and +200 MiB on the loop)."""
    client, server = app_client(hf_engine, max_sync_body_bytes=1 << 20, max_json_values=1 << 16)
    big = adversarial.big_peft_config(2 << 20)
    reply = client.post("/update_adapter_flattened_param/", content=big, headers=JSON)
    assert reply.status_code == 409 and "sync lease" in reply.text  # nothing read without the lease
    lease = _lease(client, free_port())
    try:
        reply = client.post("/update_adapter_flattened_param/", content=big, headers={**JSON, **lease})
        assert reply.status_code == 413 and "--max-sync-body-bytes" in reply.text, reply.text
        within = adversarial.big_peft_config(900_000)  # within the route's cap, over the value cap
        reply = client.post("/update_adapter_flattened_param/", content=within, headers={**JSON, **lease})
        assert reply.status_code == 413 and "--max-json-values" in reply.text, reply.text
    finally:
        assert client.post("/close_communicator/", headers=lease).status_code == 200
    assert server.stats().communicator == "none"


def test_a_sync_call_without_the_lease_is_answered_before_its_body_arrives(hf_server: Any) -> None:
    """The former route read and parsed the whole body before looking at the lease: this head,
    whose 8 MiB body never comes, got no answer until the read deadline closed it."""
    host, port = hf_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /update_adapter_flattened_param/ HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 8388608\r\n\r\n" + b"{" * 1000
        )
        sock.settimeout(5)
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 409"), head[:200]


# ------------------------------------------------------------------------------------ gate
def test_health_gives_no_internals_without_the_key(
    hf_engine: Any, app_client: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``/health/`` answered the exception text behind a 503 to anyone."""
    client, server = app_client(hf_engine, api_key="s3cret")
    # Fault: the scheduler's broken state as a failed load leaves it (the shared engine takes no load).
    reason = "loading weight version 3 failed half-way (RuntimeError: /secret/path/shard-7 CUDA 700)"
    monkeypatch.setattr(server.scheduler, "_broken", reason)
    open_reply = client.get("/health/")
    assert open_reply.status_code == 503 and open_reply.json()["status"] == "broken"
    assert "/secret/path" not in open_reply.text and "RuntimeError" not in open_reply.text
    keyed = client.get("/health/", headers={"Authorization": "Bearer s3cret"})
    assert keyed.status_code == 503 and "/secret/path" in keyed.json()["detail"]


def test_websocket_scopes_are_refused_at_the_gate() -> None:
    """The gate passed every non-HTTP scope to the app, websockets included, without the token."""
    from rollmatch.server.gate import RequestGate

    reached: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["type"])

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    gate = RequestGate(app, api_key="s3cret", max_body_bytes=1000)
    asyncio.run(gate({"type": "websocket", "path": "/infer/", "headers": []}, receive, send))
    assert reached == [] and sent[0]["type"] == "websocket.close"
    asyncio.run(gate({"type": "lifespan"}, receive, send))
    assert reached == ["lifespan"]
