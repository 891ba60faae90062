"""HTTP framing attacks on a real keyed ``rollmatch serve`` process: a refusal sent before the body
is read closes the connection (the former 401 / 413 left uvicorn parsing an unwanted upload on the
event loop: 1-byte chunks at ~2 MB/s held ``/health/`` for 8.5 s), chunked bodies are refused, and
so is a request with both length headers.

Each attack: every ``/health/`` probe answered within 1 s, server RSS growth <= 300 MB, a 4xx within
2 s and the connection closed within 2 s (it used to last until the client stopped sending).
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from attack_probe import assert_bounded, attack, filler, health_watch, http_head, one_byte_chunks, rss_mib

KEY = "attack-test-key-0123456789"
AUTH = f"Authorization: Bearer {KEY}"
ATTACK_S = 4.0
ATTACK_BYTES = 48 << 20


@pytest.fixture(scope="module")
def keyed_server(start_server: Callable[..., Any], tiny_model_dir: Path) -> Any:
    return start_server(tiny_model_dir, "--engine", "hf", "--api-key", KEY, "--max-body-bytes", str(8 << 20))


def _run(server: Any, head: bytes, body: Callable[[int], bytes | None], what: str) -> Any:
    before = rss_mib(server.process.pid)
    with health_watch(server.url, server.process.pid) as record:
        result = attack(server.url, head, body, seconds=ATTACK_S)
    assert result.status is not None and 400 <= result.status < 500, (what, result.answer[:300])
    assert result.answered_after_s is not None and result.answered_after_s < 2.0, (what, result)
    assert b"connection: close" in result.answer.lower(), (what, result.answer[:300])
    assert result.closed_after_s is not None and result.closed_after_s < 2.0, (
        f"{what}: the server kept reading the refused body ({result.sent_bytes} bytes sent in "
        f"{result.closed_after_s} s)"
    )
    assert_bounded(record, before, what)
    return result


def test_a_keyless_one_byte_chunked_upload_is_refused_and_closed(keyed_server: Any) -> None:
    head = http_head("POST", "/infer/", "Content-Type: application/json", "Transfer-Encoding: chunked")
    result = _run(keyed_server, head, one_byte_chunks(ATTACK_BYTES), "keyless chunked")
    assert result.status == 401


def test_a_keyless_upload_with_a_length_is_refused_and_closed(keyed_server: Any) -> None:
    head = http_head("POST", "/infer/", "Content-Type: application/json", f"Content-Length: {ATTACK_BYTES}")
    assert _run(keyed_server, head, filler(ATTACK_BYTES), "keyless length").status == 401


def test_a_keyed_chunked_upload_is_a_411_and_closed(keyed_server: Any) -> None:
    head = http_head("POST", "/infer/", AUTH, "Content-Type: application/json", "Transfer-Encoding: chunked")
    result = _run(keyed_server, head, one_byte_chunks(ATTACK_BYTES), "keyed chunked")
    assert result.status == 411 and b"Content-Length" in result.answer


def test_both_length_headers_are_refused(keyed_server: Any) -> None:
    head = http_head(
        "POST",
        "/infer/",
        AUTH,
        "Content-Type: application/json",
        "Content-Length: 5",
        "Transfer-Encoding: chunked",
    )
    result = _run(keyed_server, head, one_byte_chunks(ATTACK_BYTES), "both lengths")
    assert result.status == 400 and b"Transfer-Encoding" in result.answer


def test_a_declared_oversize_body_is_a_413_and_closed(keyed_server: Any) -> None:
    head = http_head(
        "POST", "/infer/", AUTH, "Content-Type: application/json", f"Content-Length: {ATTACK_BYTES}"
    )
    assert _run(keyed_server, head, filler(ATTACK_BYTES), "declared oversize").status == 413


def test_a_sync_call_without_the_lease_is_a_4xx_and_closed(keyed_server: Any) -> None:
    head = http_head(
        "POST", "/update_flattened_params/", AUTH, "Content-Type: application/json", "Content-Length: 8000000"
    )
    assert _run(keyed_server, head, filler(8_000_000), "sync without lease").status == 409


def _refusal_counts(log_text: str) -> list[int]:
    """How many refusals each of the server's refusal lines reports (a single one, or a summary)."""
    counts = []
    for line in log_text.splitlines():
        if "rollmatch.server.gate" not in line or " refused " not in line:
            continue
        summary = re.search(r" refused (\d+) more request", line)
        counts.append(int(summary.group(1)) if summary else 1)
    return counts


def test_a_keyless_connect_loop_is_refused_and_logged_at_a_bounded_rate(keyed_server: Any) -> None:
    """Formerly a 401 on a request without a body kept the connection open, and refusals were either
    logged once each or not at all; now every 401 closes its connection and the log gets at most one
    line per interval, counting every refusal."""
    from rollmatch.server.gate import REFUSAL_LOG_INTERVAL_S

    refused = 300
    host, port = keyed_server.url.removeprefix("http://").split(":")
    logged_before = len(keyed_server.log_path.read_text(errors="replace"))
    before = rss_mib(keyed_server.process.pid)
    started = time.monotonic()
    with health_watch(keyed_server.url, keyed_server.process.pid) as record:
        for index in range(refused):
            with socket.create_connection((host, int(port)), timeout=2.0) as sock:
                sock.sendall(http_head("GET", "/info/" if index % 2 else "/stats/"))
                answer = b""
                while chunk := sock.recv(65536):  # to the server's close (a 2 s timeout raises)
                    answer += chunk
            assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" in answer.lower(), answer[:300]
    assert_bounded(record, before, "keyless connect loop")
    deadline = time.monotonic() + 10 * REFUSAL_LOG_INTERVAL_S
    while (
        sum(counts := _refusal_counts(keyed_server.log_path.read_text(errors="replace")[logged_before:]))
        < refused
    ):
        assert time.monotonic() < deadline, f"refusals logged: {counts} of {refused}"
        time.sleep(0.2)
    took = time.monotonic() - started
    assert sum(counts) - refused <= 8  # every refusal counted (plus the module's earlier keyless tests')
    assert len(counts) <= 2 + took / REFUSAL_LOG_INTERVAL_S, (len(counts), took)
