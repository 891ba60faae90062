"""Clients that call a real rollout server without pause, and weight pushes made while they run.

Used by the update-under-load tests of both engines (``test_concurrency.py``, ``test_vllm_server.py``):
:func:`pushes_under_load` pushes two alternating weight sets while K clients call ``/infer/``, and
returns what every call got, so a test can check each answer against the reference output of the
weights its version names.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import requests
import torch

from rollmatch.protocol import InferBody, InferRequest, request_config_from_decoding
from rollmatch.rollout.types import Decoding


@dataclass
class LoadResult:
    reference: dict[str, list[list[int]]]  # weight set name -> greedy response ids per prompt
    version_weights: dict[int, str]  # pushed version -> weight set name
    answers: list[tuple[int, int, list[list[int]]]] = field(default_factory=list)  # status, version, ids
    push_seconds: list[float] = field(default_factory=list)
    idle_call_seconds: float = 0.0


def prepared_prompts(server: Any, rollout_requests: list[Any]) -> list[Any]:
    """The trainer's requests as a server's engine gets them (``PreparedPrompt``), for in-process tests."""
    from rollmatch.protocol import encode_image

    wire = [
        InferRequest(prompt_token_ids=list(r.prompt_token_ids), images=[encode_image(i) for i in r.images])
        for r in rollout_requests
    ]
    return [server.engine.preparer.prepare(r, i) for i, r in enumerate(wire)]


def wait_for(scheduler: Any, ticket: Any) -> list[Any]:
    """A ticket's engine outputs, waited for as ``/infer/`` does (``wait_async``: fails once the
    engine is stalled, raises the call's error)."""
    return list(asyncio.run(scheduler.wait_async(ticket)))


def infer_in_process(server: Any, body: Any) -> list[Any]:
    """What ``/infer/`` answers for ``body`` on an in-process ``RolloutServer`` (no HTTP)."""
    with server.scheduler.arrival():
        call = server.prepare(body)
        ticket = server.submit(call)
    if ticket is not None:
        wait_for(server.scheduler, ticket)
    return list(server.outputs(call, ticket))


def infer_payload(side: Any, rollout_requests: list[Any], decoding: Decoding) -> bytes:
    """The ``/infer/`` body the trainer's client would send for these requests (token ids + images)."""
    body = InferBody(
        infer_requests=[
            InferRequest(
                prompt_token_ids=list(r.prompt_token_ids),
                images=side.backend.image_wire.encode(r),
                sample_id=r.sample_id,
            )
            for r in rollout_requests
        ],
        request_config=request_config_from_decoding(decoding, 0),
    )
    return body.model_dump_json(exclude_none=True).encode()


def post_infer(session: requests.Session, url: str, payload: bytes) -> tuple[int, int, list[list[int]]]:
    reply = session.post(
        f"{url}/infer/", data=payload, headers={"Content-Type": "application/json"}, timeout=120
    )
    if reply.status_code != 200:
        return reply.status_code, -1, []
    items = reply.json()
    versions = {item["weight_version"] for item in items}
    assert len(versions) == 1, f"one call answered with several versions: {versions}"
    assert {item["weight_version_last"] for item in items} == versions  # drain mode: nothing mixed
    return 200, versions.pop(), [item["response_token_ids"][0] for item in items]


def pushes_under_load(
    url: str, side: Any, rollout_requests: list[Any], decoding: Decoding, *, clients: int = 4, pushes: int = 4
) -> LoadResult:
    """Push weight sets A and B alternately while ``clients`` threads call ``/infer/`` without pause."""
    model, backend = side.model, side.backend
    weights_a = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():  # weight set B: every weight moved, so greedy outputs differ
        generator = torch.Generator().manual_seed(1)
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    weights_b = {k: v.clone() for k, v in model.state_dict().items()}
    payload = infer_payload(side, rollout_requests, decoding)
    session = requests.Session()

    def push(name: str, version: int, result: LoadResult) -> None:
        model.load_state_dict(weights_a if name == "A" else weights_b)
        started = time.monotonic()
        backend.sync_weights(model, version)
        result.push_seconds.append(time.monotonic() - started)
        result.version_weights[version] = name

    result = LoadResult(reference={}, version_weights={})
    for version, name in ((1, "A"), (2, "B")):  # references: each weight set served alone
        push(name, version, result)
        started = time.monotonic()
        status, served, ids = post_infer(session, url, payload)
        result.idle_call_seconds = max(result.idle_call_seconds, time.monotonic() - started)
        assert status == 200 and served == version
        result.reference[name] = ids
    assert result.reference["A"] != result.reference["B"], "the two weight sets must decode differently"
    result.push_seconds.clear()

    stop = threading.Event()
    lock = threading.Lock()

    def client() -> None:
        own = requests.Session()
        while not stop.is_set():
            answer = post_infer(own, url, payload)
            with lock:
                result.answers.append(answer)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    time.sleep(result.idle_call_seconds)  # every client has a call in flight
    for version in range(3, 3 + pushes):
        push("A" if version % 2 else "B", version, result)
        time.sleep(result.idle_call_seconds / 2)
    stop.set()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a client is still waiting for its call"
    return result


def check_load_result(result: LoadResult, engine: str, *, pushes: int = 4) -> None:
    """Every answer is a 200 whose output is the reference of the weights its version names; every
    push took at most ten idle generation calls (plus 0.5 s for the transfer itself). Prints the figures."""
    print(
        f"{engine}: {len(result.answers)} answers, pushes {[round(s, 2) for s in result.push_seconds]} s, "
        f"one idle call {result.idle_call_seconds:.2f} s"
    )
    statuses = [status for status, _, _ in result.answers]
    assert statuses and set(statuses) == {200}, statuses
    versions_seen = set()
    for _, version, ids in result.answers:
        name = result.version_weights[version]
        assert ids == result.reference[name], f"an answer of v{version} is not weight set {name}'s output"
        versions_seen.add(version)
    assert len(result.push_seconds) == pushes
    assert len(versions_seen) >= 2, versions_seen  # answers came from several versions
    # Idle, a push waits for the calls in flight (about one call) and loads; 10x that is the bound. An
    # unfair update (new calls admitted while it waits) waits until the drain timeout (60 s by default)
    # aborts them: with a 24-token call (well under 1 s here), the bound still fails on that bug.
    bound = 10 * result.idle_call_seconds + 0.5
    assert max(result.push_seconds) <= bound, (result.push_seconds, result.idle_call_seconds)
