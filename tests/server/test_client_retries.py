"""The client's two retries, against small real HTTP servers on 127.0.0.1 that inject the fault: a
429 is waited out within the call's time (``Retry-After``), and a connection closed before any
byte of the answer is sent again once."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from rollmatch.errors import BackendError, ServerBusy, SyncError
from rollmatch.rollout.connection import ServerConnection

Script = Callable[[int], str]  # call number -> "close" | "busy" | "ok"


@pytest.fixture
def scripted_server() -> Iterator[Callable[[Script], tuple[str, list[float]]]]:
    servers: list[ThreadingHTTPServer] = []

    def start(script: Script) -> tuple[str, list[float]]:
        seen: list[float] = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                seen.append(time.monotonic())
                action = script(len(seen))
                if action == "close":  # the idle keep-alive race: closed before any byte of the answer
                    self.close_connection = True
                    self.connection.close()
                    return
                status, body = (429, {"detail": "queue full"}) if action == "busy" else (200, {"ok": True})
                payload = json.dumps(body).encode()
                self.send_response(status)
                if status == 429:
                    self.send_header("Retry-After", "1")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *_: object) -> None:
                return None

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", seen

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_a_connection_closed_before_the_answer_is_sent_again_once(
    scripted_server: Callable[..., Any],
) -> None:
    url, seen = scripted_server(lambda n: "close" if n == 1 else "ok")
    conn = ServerConnection(url, 0, timeout_s=5, infer_timeout_s=None)
    assert conn.post_bytes("/infer/", b"{}", "rollout", timeout_s=5).json() == {"ok": True}
    assert len(seen) == 2

    url, seen = scripted_server(lambda n: "close")
    conn = ServerConnection(url, 0, timeout_s=5, infer_timeout_s=None)
    with pytest.raises(BackendError, match=r"rollout \(POST /infer/\) failed"):
        conn.post_bytes("/infer/", b"{}", "rollout", timeout_s=5)
    assert len(seen) == 2  # one resend, no more


def test_a_busy_server_is_waited_out_within_the_calls_time(scripted_server: Callable[..., Any]) -> None:
    url, seen = scripted_server(lambda n: "busy" if n <= 2 else "ok")
    conn = ServerConnection(url, 0, timeout_s=10, infer_timeout_s=None)
    assert conn.post_bytes("/infer/", b"{}", "rollout", timeout_s=10).json() == {"ok": True}
    assert len(seen) == 3 and seen[1] - seen[0] <= 1.5  # within the Retry-After window (full jitter)

    url, seen = scripted_server(lambda n: "busy")
    conn = ServerConnection(url, 0, timeout_s=3, infer_timeout_s=None)
    started = time.monotonic()
    with pytest.raises(ServerBusy, match="HTTP 429 until the call's time ran out"):
        conn.post_bytes("/infer/", b"{}", "rollout", timeout_s=3)
    assert time.monotonic() - started < 3.5 and len(seen) >= 2


def test_a_weight_sync_call_that_may_have_reached_the_server_is_never_sent_twice(
    scripted_server: Callable[..., Any],
) -> None:
    """Each sync-state call posts a receive on the group or moves the lease: a second copy would
    desynchronise the group, so a connection closed before the answer fails the call, naming it."""
    url, seen = scripted_server(lambda n: "close")
    conn = ServerConnection(url, 0, timeout_s=5, infer_timeout_s=None)
    with pytest.raises(
        SyncError, match=r"announce bucket 0 of version 3 \(POST /update_flattened_params/\).*not sent twice"
    ):
        conn.post_bytes("/update_flattened_params/", b"{}", "announce bucket 0 of version 3", timeout_s=5)
    assert len(seen) == 1
    with pytest.raises(SyncError, match=r"finish version 3 \(POST /finish_weight_update/\)"):
        conn.post_bytes("/finish_weight_update/", b"{}", "finish version 3", timeout_s=5)
    assert len(seen) == 2


def test_clients_refused_together_do_not_retry_together(scripted_server: Callable[..., Any]) -> None:
    """Full jitter: each client's wait after a 429 is drawn from [0, window]. Before, every client
    slept exactly ``Retry-After`` (1 s) and came back in lockstep (this spread was ~0)."""
    first_seen: dict[int, float] = {}
    url, seen = scripted_server(lambda n: "busy" if n <= 8 else "ok")
    clients = [ServerConnection(url, 0, timeout_s=10, infer_timeout_s=None) for _ in range(8)]
    started = time.monotonic()
    threads = [
        threading.Thread(target=c.post_bytes, args=("/infer/", b"{}", "rollout"), kwargs={"timeout_s": 10})
        for c in clients
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=15)
    assert len(seen) == 16, seen
    first_seen = dict(enumerate(sorted(t - started for t in seen[8:])))
    spread = max(first_seen.values()) - min(first_seen.values())
    assert spread > 0.2, f"retries came back together: {sorted(first_seen.values())}"
