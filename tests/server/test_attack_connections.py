"""Connection attacks on the rollout server's HTTP loop: a stalled upload pipelined behind another
request still meets the read deadline, and a client may not stream bytes into the server while its
call waits for the engine.

Formerly: an upload sent behind a ``GET /health/`` in the same packet was still open at 3x the
deadline (holding its body reservation and a connection slot), and a waiting call's pipelined
bytes were buffered without bound (+10 MB in 10 s on one call).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from attack_probe import assert_bounded, attack, health_watch, http_head, rss_mib

from rollmatch.server.limits import ServerLimits
from rollmatch.server.rollout_server import RolloutServer

READ_TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def deadline_server(start_server: Callable[..., Any], tiny_model_dir: Path) -> Any:
    return start_server(tiny_model_dir, "--engine", "hf", "--request-read-timeout-s", str(READ_TIMEOUT_S))


def test_a_stalled_upload_pipelined_behind_a_health_probe_meets_the_read_deadline(
    deadline_server: Any,
) -> None:
    pipelined = http_head("GET", "/health/") + http_head(
        "POST", "/infer/", "Content-Type: application/json", "Content-Length: 40000000"
    )
    before = rss_mib(deadline_server.process.pid)
    with health_watch(deadline_server.url, deadline_server.process.pid) as record:
        result = attack(
            deadline_server.url, pipelined + b" " * 1000, lambda i: None, seconds=3 * READ_TIMEOUT_S
        )
    assert result.status == 200, result.answer[:200]
    assert result.closed_after_s is not None and result.closed_after_s < READ_TIMEOUT_S + 1.0, result
    assert_bounded(record, before, "pipelined stalled upload")


@pytest.fixture
def wedged_app(
    hf_engine: Any, free_port: Callable[[], int]
) -> Iterator[tuple[str, RolloutServer, threading.Event]]:
    """The real app on uvicorn with the server's h11 protocol, in this process, its engine held by
    an operation until the test sets the returned event: a call waits as long as the test wants."""
    import uvicorn

    from rollmatch.server.app import build_app
    from rollmatch.server.connections import guarded_h11_protocol

    server = RolloutServer(hf_engine, ServerLimits())
    port = free_port()
    config = uvicorn.Config(
        build_app(server),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        http=guarded_h11_protocol(server.limits.request_read_timeout_s, server.limits.max_connections),
    )
    runner = uvicorn.Server(config)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not runner.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    release = threading.Event()
    wedge = threading.Thread(
        target=lambda: server.scheduler.run_operation(
            "test wedge", lambda: release.wait(60) and None, is_load=False
        ),
        daemon=True,
    )
    wedge.start()
    yield f"http://127.0.0.1:{port}", server, release
    release.set()
    wedge.join(30)
    runner.should_exit = True
    thread.join(15)
    server.scheduler.close()
    server.sync.shutdown()


def test_bytes_sent_while_a_call_waits_are_bounded(
    wedged_app: tuple[str, RolloutServer, threading.Event],
) -> None:
    url, server, _ = wedged_app
    body = b'{"infer_requests":[{"prompt_token_ids":[5,6,7]}],"request_config":{"max_tokens":2}}'
    head = http_head("POST", "/infer/", "Content-Type: application/json", f"Content-Length: {len(body)}")
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + body)
        for _ in range(200):  # the call is queued behind the wedge (bounded wait)
            if server.health().queued_calls:
                break
            time.sleep(0.05)
        assert server.health().queued_calls == 1
        started = time.monotonic()
        sent, closed = 0, False
        sock.settimeout(0.05)
        while time.monotonic() - started < 5.0 and sent < (16 << 20):
            try:
                sock.sendall(b"x" * (64 << 10))
                sent += 64 << 10
                if sock.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
        took = time.monotonic() - started
    assert closed and took < 2.0, f"the server kept reading: {sent} bytes in {took:.1f} s"
    assert sent <= 8 << 20, sent
