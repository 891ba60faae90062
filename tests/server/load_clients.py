"""Clients that call a real rollout server without pause, and weight pushes made while they run.

Used by the update-under-load tests of both engines (``test_concurrency.py``, ``test_vllm_server.py``):
:func:`pushes_under_load` pushes two alternating weight sets while K clients call ``/infer/``, and
returns what every call got, so a test can check each answer against the reference output of the
weights its version names. The server runs with a step gate (``gated_server.py``): before each push
the gate holds the engine until every client has a call in flight and the push waits on the engine,
so every push meets calls in flight and answers of several versions come back on any machine.
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
    # (pushed version, answer) of the call sent while that push waited for the calls in flight
    late_answers: list[tuple[int, tuple[int, int, list[list[int]]]]] = field(default_factory=list)


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
    server: Any,
    side: Any,
    rollout_requests: list[Any],
    decoding: Decoding,
    *,
    clients: int = 4,
    pushes: int = 4,
) -> LoadResult:
    """Push weight sets A and B alternately while ``clients`` threads call ``/infer/`` without pause.
    ``server``: a gated ``ServerProcess`` (``start_server(..., gated=True)``). A push's time counts
    from the gate's release, when the calls it found in flight start to run."""
    assert server.step_gate is not None, "pushes_under_load needs a gated server (gated=True)"
    url, gate = server.url, server.step_gate
    model, backend = side.model, side.backend
    weights_a = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():  # weight set B: every weight moved, so greedy outputs differ
        generator = torch.Generator().manual_seed(1)
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    weights_b = {k: v.clone() for k, v in model.state_dict().items()}
    payload = infer_payload(side, rollout_requests, decoding)
    session = requests.Session()

    def push(name: str, version: int) -> None:
        model.load_state_dict(weights_a if name == "A" else weights_b)
        backend.sync_weights(model, version)
        result.version_weights[version] = name

    result = LoadResult(reference={}, version_weights={})
    for version, name in ((1, "A"), (2, "B")):  # references: each weight set served alone
        push(name, version)
        started = time.monotonic()
        status, served, ids = post_infer(session, url, payload)
        result.idle_call_seconds = max(result.idle_call_seconds, time.monotonic() - started)
        assert status == 200 and served == version
        result.reference[name] = ids
    assert result.reference["A"] != result.reference["B"], "the two weight sets must decode differently"

    stop = threading.Event()
    lock = threading.Lock()
    failures: list[BaseException] = []

    def client() -> None:
        own = requests.Session()
        while not stop.is_set():
            answer = post_infer(own, url, payload)
            with lock:
                result.answers.append(answer)

    def until(what: str, condition: Any) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT_LIMIT_S
        while True:
            health = requests.get(f"{url}/health/", timeout=30).json()
            if condition(health):
                return health
            assert time.monotonic() < deadline, f"{what}: not within {WAIT_LIMIT_S:g}s ({health})"
            assert not failures, failures
            time.sleep(0.02)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    try:
        gate.touch()
        for thread in threads:
            thread.start()
        for version in range(3, 3 + pushes):
            # Held: every client's call waits in the server (none can finish while the gate is held).
            until(
                "every client has a call in flight",
                lambda h: h["queued_calls"] + h["running_calls"] == clients,
            )
            pushing = threading.Thread(
                target=_recorded(failures, push), args=("A" if version % 2 else "B", version), daemon=True
            )
            pushing.start()
            until(
                "the push waits on the engine",
                lambda h, p=pushing: h["pending_operations"] >= 1 or not p.is_alive(),
            )
            # A call that arrives while the push waits: fair, it runs under the pushed weights.
            late: list[tuple[int, int, list[list[int]]]] = []
            calling = threading.Thread(
                target=_recorded(
                    failures, lambda out=late: out.append(post_infer(requests.Session(), url, payload))
                ),
                daemon=True,
            )
            calling.start()
            until("the late call arrived", lambda h: h["queued_calls"] + h["running_calls"] > clients)
            released = time.monotonic()
            gate.unlink()
            pushing.join(timeout=WAIT_LIMIT_S)
            assert not pushing.is_alive() and not failures, f"push of v{version}: {failures}"
            result.push_seconds.append(time.monotonic() - released)
            calling.join(timeout=WAIT_LIMIT_S)
            assert len(late) == 1 and not failures, f"the call sent while v{version} waited: {failures}"
            result.late_answers.append((version, late[0]))
            gate.touch()
    finally:
        gate.unlink(missing_ok=True)
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a client is still waiting for its call"
    return result


WAIT_LIMIT_S = 120.0  # the calls and pushes take a few seconds idle; this turns a hang into an error


def _recorded(failures: list[BaseException], fn: Any) -> Any:
    def run(*args: Any) -> None:
        try:
            fn(*args)
        except BaseException as error:  # the test thread reports it
            failures.append(error)

    return run


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
    # Fair: a call that arrived while a push waited for the calls in flight ran after the load (an
    # unfair update serves it under the old weights first).
    assert len(result.late_answers) == pushes
    for version, (status, served, ids) in result.late_answers:
        assert status == 200 and served == version, (version, status, served)
        assert ids == result.reference[result.version_weights[version]]
    assert len(versions_seen) >= 2, versions_seen  # answers came from several versions
    # Idle, a push waits for the calls in flight (about one call) and loads; 10x that is the bound. An
    # unfair update (new calls admitted while it waits) waits until the drain timeout (60 s by default)
    # aborts them: with a 24-token call (well under 1 s here), the bound still fails on that bug.
    bound = 10 * result.idle_call_seconds + 0.5
    assert max(result.push_seconds) <= bound, (result.push_seconds, result.idle_call_seconds)
