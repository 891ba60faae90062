"""The ``/infer/`` path itself: where its time goes, and how strictly its raw body is read.

The server reports its phases in a ``Server-Timing`` header and the client keeps an ``InferTiming``
per call (real ``rollmatch serve`` process on 127.0.0.1). ``/infer/`` parses its body itself, so
the body must be JSON under a JSON content type, and every malformed body is a 422 naming what is
wrong (real app + real HF engine, in process).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rollmatch.collectives import LocalCollectives
from rollmatch.config.resolved import resolve_run_on_this_machine
from rollmatch.errors import BackendError
from rollmatch.protocol import format_server_timing, parse_server_timing
from rollmatch.rollout.client import ServerBackend, ServerConnection
from rollmatch.rollout.replies import parse_infer_reply
from rollmatch.rollout.types import Decoding
from rollmatch.server.timing import PhaseTimes

DECODING = Decoding(max_new_tokens=6)
SERVER_PHASES = {"receive", "parse", "prepare", "decode", "preprocess", "engine", "outputs", "respond"}


def test_nested_phases_count_only_for_themselves() -> None:
    times = PhaseTimes()
    started = time.perf_counter()
    with times.phase("outer"):
        time.sleep(0.02)
        with times.phase("inner"):
            time.sleep(0.05)
    outer_wall = time.perf_counter() - started
    with times.phase("inner"):
        time.sleep(0.01)
    assert list(times.seconds) == ["inner", "outer"]  # first closed first
    # Sleeps only ever overrun (more on a loaded machine), so bound by what this block measured:
    # the nested phase slept >= 0.05 s of the outer block's wall time, and none of it counts for outer.
    assert 0.015 <= times.seconds["outer"] <= outer_wall - 0.045
    assert times.seconds["inner"] >= 0.06


def test_server_timing_header_round_trips_in_milliseconds() -> None:
    header = format_server_timing({"parse": 0.0012, "engine": 0.25})
    assert header == "parse;dur=1.200, engine;dur=250.000"
    assert parse_server_timing(header) == pytest.approx({"parse": 0.0012, "engine": 0.25})
    assert parse_server_timing('cache;desc="hit", db;dur=x, app;dur=5') == {"app": 0.005}
    assert parse_server_timing("") == {}


def test_every_infer_call_reports_client_and_server_phases(
    hf_server: Any,
    server_config: Callable[..., Any],
    raccoon_requests: list[Any],
    loaded_tiny: tuple[Any, Any],
    prompt_encoder: Any,
    free_port: Callable[[], int],
    tiny_model_dir: Path,
) -> None:
    backend = ServerBackend.connect(
        resolve_run_on_this_machine(
            server_config(servers=[{"base_url": hf_server.url, "group_port": free_port()}])
        ),
        model=loaded_tiny[0],
        tokenizer=prompt_encoder.tokenizer,
        collectives=LocalCollectives(),
        processor=prompt_encoder.processor,
    )
    assert backend.last_infer_timings == []
    rollouts = backend.generate(raccoon_requests, DECODING, seed=0)
    [timing] = backend.last_infer_timings
    assert timing.server == hf_server.url and timing.requests == len(rollouts) == 3
    assert set(timing.server_s) == SERVER_PHASES
    assert timing.server_s["engine"] > 0 and timing.server_s["decode"] > 0
    assert min(timing.encode_s, timing.serialize_s, timing.parse_s) > 0
    assert 0 < sum(timing.server_s.values()) <= timing.round_trip_s and timing.transfer_s >= 0
    assert timing.request_bytes > 3 * 10_000 and timing.reply_bytes > 0  # three encoded photographs
    backend.close()


@pytest.fixture
def client(hf_engine: Any, app_client: Callable[..., Any]) -> Any:
    return app_client(hf_engine, max_tokens=4)[0]


@pytest.mark.parametrize(
    ("body", "content_type", "needle"),
    [
        (b'{"infer_requests": []}', "text/plain", "Content-Type: application/json"),
        (b'{"infer_requests": []}', None, "Content-Type: application/json"),
        (b'{"infer_requests": [', "application/json", "body: Invalid JSON"),
        (b"[" * 5000, "application/json", "body: Invalid JSON"),
        (b'{"infer_requests": [{"sample_id": "\xff\xfe"}]}', "application/json", "body: "),
        (b"[1, 2]", "application/json", "body: "),
        (b'{"infer_requests": [{"prompt_token_ids": [1], "images": 5}]}', "application/json", "images"),
    ],
    ids=lambda value: f"{len(value)}_bytes" if isinstance(value, bytes) and len(value) > 64 else None,
)
def test_a_body_that_is_not_a_valid_json_request_is_a_422(
    client: Any, body: bytes, content_type: str | None, needle: str
) -> None:
    headers = {"content-type": content_type} if content_type else {}
    reply = client.post("/infer/", content=body, headers=headers)
    assert reply.status_code == 422, reply.text
    assert needle in reply.json()["error"] and "\\xff" not in reply.text  # never echoes the input


def test_a_good_body_with_a_json_content_type_and_charset_is_served(client: Any) -> None:
    body = b'{"infer_requests": [{"prompt_token_ids": [5, 6]}], "request_config": {"max_tokens": 2}}'
    reply = client.post("/infer/", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert reply.status_code == 200, reply.text
    assert reply.headers["X-Weight-Version"] == "0"
    assert set(parse_server_timing(reply.headers["Server-Timing"])) == SERVER_PHASES


def test_an_answer_that_is_not_a_list_of_outputs_names_the_server() -> None:
    conn = ServerConnection("http://127.0.0.1:9", 1, timeout_s=1.0, infer_timeout_s=None)
    for content, needle in (
        (b'{"detail": "x"}', "not a list of rollout outputs"),
        (b"<html>", "Invalid JSON"),
    ):
        with pytest.raises(BackendError, match=needle) as caught:
            parse_infer_reply(conn, content, 1)
        assert "http://127.0.0.1:9" in str(caught.value)
    with pytest.raises(BackendError, match="sent 2 requests, got 0 outputs"):
        parse_infer_reply(conn, b"[]", 2)
    conn.close()
