"""Body floods on a real ``rollmatch serve`` process: invalid-value and unknown-key floods within
every size cap cost what a valid body of their size costs (fail-fast validation, one error for
unknown keys, a summary rendered), not one rendered error per bad value.

Formerly: 1,048,000 prompt ids of ``-1`` (3.1 MB) cost 10 s of CPU, +1.5 GB and a 4.7 s stall of
``/health/``; 300k unknown keys 2 s and +307 MB. Each attack here: every ``/health/`` probe within
1 s, server RSS growth <= 300 MB, the 422 within 2 s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests
from attack_probe import assert_bounded, health_watch, rss_mib

from rollmatch.server import adversarial

JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def body_server(start_server: Callable[..., Any], tiny_model_dir: Path) -> Any:
    return start_server(tiny_model_dir, "--engine", "hf")


@pytest.mark.parametrize(
    ("name", "body", "status", "field"),
    [
        ("invalid_prompt_ids", adversarial.invalid_prompt_ids(1_048_000), 422, "prompt_token_ids"),
        ("unknown_keys", adversarial.unknown_keys(300_000), 413, "--max-json-keys"),
        ("unknown_keys_under_the_key_cap", adversarial.unknown_keys(60_000), 422, "(+59995 more)"),
        ("non_string_images", adversarial.non_string_images(1_000_000), 422, "images"),
    ],
    ids=lambda value: "body" if isinstance(value, bytes) else None,  # not megabytes of id (nor of env)
)
def test_a_flood_of_bad_values_costs_what_a_valid_body_costs(
    body_server: Any, name: str, body: bytes, status: int, field: str
) -> None:
    before = rss_mib(body_server.process.pid)
    with health_watch(body_server.url, body_server.process.pid) as record:
        for _ in range(3):
            started = time.monotonic()
            reply = requests.post(f"{body_server.url}/infer/", data=body, headers=JSON, timeout=30)
            took = time.monotonic() - started
            assert reply.status_code == status, (name, reply.status_code, reply.text[:300])
            assert took < 2.0, (name, took)
            assert field in reply.text and len(reply.content) < 8192, (name, reply.text[:500])
        time.sleep(0.3)  # a probe after the last one, too
    assert_bounded(record, before, name)
