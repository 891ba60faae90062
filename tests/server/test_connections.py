"""Connection hygiene of a real ``rollmatch serve`` process: slow or stalled senders are cut off at the
read deadline, idle half-sent connections cannot crowd out a fresh ``/health/``, and the cap never
closes an upload that sent its head."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests
from attack_probe import wait_until_read

READ_TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def strict_server(start_server: Callable[..., Any], tiny_model_dir: Path) -> Any:
    return start_server(
        tiny_model_dir,
        "--engine",
        "hf",
        "--request-read-timeout-s",
        str(READ_TIMEOUT_S),
        "--keep-alive-timeout-s",
        "1",
        "--max-connections",
        "32",
    )


@pytest.fixture(scope="module")
def capped_server(start_server: Callable[..., Any], tiny_model_dir: Path) -> Any:
    return start_server(tiny_model_dir, "--engine", "hf", "--max-connections", "8")


def _port(server: Any) -> int:
    return int(server.url.rsplit(":", 1)[1])


def _connect(server: Any) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float:
    """Send ``trickle`` a byte at a time (0.3 s apart) until the server closes; seconds it took."""
    started = time.monotonic()
    sock.settimeout(0.3)
    position = 0
    while time.monotonic() - started < seconds:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - started
        except TimeoutError:
            pass
        except ConnectionResetError:
            return time.monotonic() - started
        if position < len(trickle):
            try:
                sock.sendall(trickle[position : position + 1])
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - started
            position += 1
    raise AssertionError(f"the server kept the connection open for {seconds}s")


def test_a_slow_header_and_a_stalled_body_are_cut_off_at_the_read_deadline(strict_server: Any) -> None:
    slow = _connect(strict_server)
    header = b"GET /health/ HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 200 + b"\r\n\r\n"
    took = _closed_within(slow, READ_TIMEOUT_S + 3, trickle=header)
    assert took < READ_TIMEOUT_S + 1.0, took

    stalled = _connect(strict_server)
    stalled.sendall(
        b"POST /infer/ HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 40000000\r\n\r\n" + b" " * (1 << 20)
    )
    took = _closed_within(stalled, READ_TIMEOUT_S + 3)
    assert took < READ_TIMEOUT_S + 1.0, took
    assert requests.get(f"{strict_server.url}/health/", timeout=5).status_code == 200


def test_idle_half_sent_connections_cannot_crowd_out_a_fresh_health_probe(strict_server: Any) -> None:
    crowd = []
    for _ in range(100):  # three times --max-connections, each with half a request head
        sock = _connect(strict_server)
        sock.sendall(b"POST /infer/ HTTP/1.1\r\nHost: x\r\n")
        crowd.append(sock)
    try:
        started = time.monotonic()
        reply = requests.get(f"{strict_server.url}/health/", timeout=5)
        assert reply.status_code == 200 and time.monotonic() - started < 1.0
    finally:
        for sock in crowd:
            sock.close()


_UPLOAD_BODY = json.dumps(
    {"infer_requests": [{"prompt_token_ids": [5, 6]}], "request_config": {"max_tokens": 1}}
)
_UPLOAD_HEAD = (
    "POST /infer/ HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    f"Content-Length: {len(_UPLOAD_BODY)}\r\n\r\n"
).encode()


def _half_sent_uploads(server: Any, count: int) -> list[socket.socket]:
    """``count`` uploads that sent their head and half their body, once the server has read them (each
    is past its head for the server: never closed for the cap)."""
    uploads = []
    for _ in range(count):
        sock = _connect(server)
        sock.sendall(_UPLOAD_HEAD + _UPLOAD_BODY[: len(_UPLOAD_BODY) // 2].encode())
        uploads.append(sock)
    wait_until_read(_port(server), uploads)
    return uploads


def _finish_uploads(uploads: list[socket.socket]) -> None:
    """Send the rest of each body; each upload must be answered 200 (none was closed meanwhile)."""
    for sock in uploads:
        sock.sendall(_UPLOAD_BODY[len(_UPLOAD_BODY) // 2 :].encode())
    for sock in uploads:
        sock.settimeout(10)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200"), "an upload past its head was closed"


def test_the_cap_keeps_uploads_that_sent_their_head_and_a_health_probe_gets_in(capped_server: Any) -> None:
    """Formerly the oldest connection not being answered was evicted, an upload mid-body included
    (here the 8 uploads would have lost one connection per newcomer), and with every slot busy the
    newcomer, a /health/ probe, was closed. Now uploads past their head stay; /health/ gets one of
    the reserved slots; any other request there is a 503."""
    uploads = _half_sent_uploads(capped_server, 8)  # every slot of the cap
    try:
        reply = requests.get(f"{capped_server.url}/health/", timeout=5)
        assert reply.status_code == 200
        other = requests.get(f"{capped_server.url}/info/", timeout=5)
        assert other.status_code == 503 and "--max-connections" in other.text
        _finish_uploads(uploads)
    finally:
        for sock in uploads:
            sock.close()


def test_idle_and_trickling_connections_cannot_hold_the_health_slots(capped_server: Any) -> None:
    """Formerly the 16 connections admitted past a full cap for ``/health/`` kept their slot until
    the read deadline (30 s by default) or, once answered, the keep-alive timeout, whatever they
    did: a client reconnecting idle sockets kept every probe out. Now an idle or trickling one gives
    its slot to a newcomer, must send its head within a short deadline, and a probe's answer closes
    its connection."""
    from rollmatch.server.connections import HEALTH_RESERVE, HEALTH_SLOT_HEAD_TIMEOUT_S

    uploads, holders = _half_sent_uploads(capped_server, 8), []  # every slot of the cap
    try:
        for index in range(2 * HEALTH_RESERVE):  # every /health/ slot, twice over: idle, then half a head
            sock = _connect(capped_server)
            if index >= HEALTH_RESERVE:
                sock.sendall(b"GET /health/ HTTP/1.1\r\nHost: x\r\n")
            holders.append(sock)
        # the half heads read: the server accepted them, and (accepting in order) the idle ones before
        wait_until_read(_port(capped_server), holders[HEALTH_RESERVE:])
        started = time.monotonic()
        reply = requests.get(f"{capped_server.url}/health/", timeout=5)
        assert reply.status_code == 200 and time.monotonic() - started < 1.0
        assert reply.headers.get("connection") == "close"  # the probe's slot is free once answered
        took = _closed_within(holders[-1], HEALTH_SLOT_HEAD_TIMEOUT_S + 5)  # no head: its slot expires
        assert took < HEALTH_SLOT_HEAD_TIMEOUT_S + 1.0, took
        _finish_uploads(uploads)
    finally:
        for sock in uploads + holders:
            sock.close()
