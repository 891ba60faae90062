"""The server's data plane: calls from many clients share the engine, weight updates are fair and
exact under load, health never waits, and a stalled engine operation fails everything waiting on it."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import requests
from load_clients import check_load_result, prepared_prompts, pushes_under_load, wait_for

from rollmatch.errors import BackendError, ServerBusy
from rollmatch.rollout.types import Decoding
from rollmatch.server.engine_watch import CACHE_RESET, WEIGHT_LOAD
from rollmatch.server.limits import ServerLimits
from rollmatch.server.rollout_server import RolloutServer

GREEDY = Decoding(max_new_tokens=6)
SAMPLED = Decoding(temperature=1.0, top_p=0.9, max_new_tokens=6)


@pytest.fixture
def in_process(hf_engine: Any) -> Any:
    made: list[RolloutServer] = []

    def make(**limits: Any) -> RolloutServer:
        server = RolloutServer(hf_engine, ServerLimits(**limits))
        made.append(server)
        return server

    yield make
    for server in made:
        server.scheduler.close()
        server.sync.shutdown()


def _ids(outputs: list[Any]) -> list[list[int]]:
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("decoding", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_concurrent_calls_join_one_batch_with_the_results_of_each_call_alone(
    in_process: Callable[..., RolloutServer], raccoon_requests: list[Any], decoding: Decoding
) -> None:
    server = in_process()
    prompts = prepared_prompts(server, raccoon_requests)
    calls = [(prompts[:2], 10), (prompts[1:], 20), (prompts, 30), (prompts[:1], 40)]
    alone = [
        _ids(wait_for(server.scheduler, server.scheduler.submit(p, decoding, seed))) for p, seed in calls
    ]
    steps: list[int] = []
    step = server.engine.step
    server.engine.step = lambda: steps.append(1) or step()  # counts engine steps (the engine is real)
    try:
        tickets = [server.scheduler.submit(p, decoding, seed) for p, seed in calls]
        together = [_ids(wait_for(server.scheduler, t)) for t in tickets]
    finally:
        del server.engine.step
    assert together == alone
    assert len(steps) == 1, f"4 calls submitted together ran in {len(steps)} engine steps"


def test_a_full_server_answers_429_with_retry_after_and_a_too_large_call_413(
    in_process: Callable[..., RolloutServer], raccoon_requests: list[Any]
) -> None:
    server = in_process(max_queued_prompts=300, max_requests_per_call=256)
    prompts = prepared_prompts(server, raccoon_requests)
    release = threading.Event()
    server.engine.step = lambda: release.wait(10) and []  # the engine holds what it was given
    try:
        first = server.scheduler.submit(prompts * 90, GREEDY, 0)  # 270 prompts outstanding
        with pytest.raises(ServerBusy) as busy:
            server.scheduler.submit(prompts * 11, GREEDY, 0)
        assert "--max-queued-prompts 300" in str(busy.value) and busy.value.retry_after_s >= 1
        with pytest.raises(ValueError, match="split the call"):
            server.scheduler.submit(prompts * 101, GREEDY, 0)
    finally:
        release.set()
        del server.engine.step
    assert len(wait_for(server.scheduler, first)) == 270
    assert len(wait_for(server.scheduler, server.scheduler.submit(prompts * 11, GREEDY, 0))) == 33


@pytest.mark.parametrize("operation", [WEIGHT_LOAD, CACHE_RESET])
def test_a_stalled_engine_operation_turns_health_503_naming_it_and_fails_waiting_calls(
    in_process: Callable[..., RolloutServer], raccoon_requests: list[Any], operation: str
) -> None:
    server = in_process(engine_stall_timeout_s=1.0)
    prompts = prepared_prompts(server, raccoon_requests)
    release = threading.Event()
    pusher_errors: list[BaseException] = []

    def wedge() -> None:  # the caller of the operation (a weight push) is told too
        try:
            server.scheduler.run_operation(operation, lambda: release.wait(30) and None, is_load=True)
        except BackendError as exc:
            pusher_errors.append(exc)

    wedged = threading.Thread(target=wedge, daemon=True)
    wedged.start()
    try:
        waiting = [server.scheduler.submit(prompts[:1], GREEDY, i) for i in range(8)]
        started = time.monotonic()
        with pytest.raises(BackendError, match=f"{operation} made no progress"):
            wait_for(server.scheduler, waiting[0])
        # The stall timeout (1 s) plus polling: ~1.3 s idle, bounded at 10x that. Without stall detection
        # the call would wait for the wedge (30 s) and then succeed, failing the ``raises`` above.
        assert time.monotonic() - started < 13.0
        health = server.health()
        assert health.status == "stalled" and health.engine == "stalled" and health.operation == operation
        assert operation in (health.detail or "")
        with pytest.raises(BackendError, match="stalled"):
            server.scheduler.submit(prompts[:1], GREEDY, 0)
        wedged.join(timeout=3)
        assert pusher_errors and "stalled" in str(pusher_errors[0])
    finally:
        release.set()
        wedged.join(timeout=10)
    deadline = time.monotonic() + 5
    while server.health().status != "ok" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.health().status == "ok"


def test_health_answers_within_a_second_while_64_calls_wait(
    hf_server: Any, raccoon_requests: list[Any]
) -> None:
    from rollmatch.protocol import InferRequest, encode_image

    request = raccoon_requests[0]
    body = {
        "infer_requests": [
            {
                **InferRequest(
                    prompt_token_ids=list(request.prompt_token_ids),
                    images=[encode_image(i) for i in request.images],
                ).model_dump(exclude_none=True),
            }
        ],
        "request_config": {"max_tokens": 8, "seed": 0},
    }

    def call(_: int) -> int:
        return requests.post(f"{hf_server.url}/infer/", json=body, timeout=120).status_code

    def waiting() -> int:
        report = requests.get(f"{hf_server.url}/health/", timeout=5).json()
        return int(report["queued_calls"] + report["running_calls"])

    # The engine's steps are held (the server's step gate) until every call waits and the probes ran:
    # how many calls wait does not depend on how fast this machine decodes them.
    assert hf_server.step_gate is not None
    hf_server.step_gate.touch()
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=64) as pool:
            futures = [pool.submit(call, i) for i in range(64)]
            deadline = time.monotonic() + 120
            while (most_waiting := waiting()) < 64:
                assert time.monotonic() < deadline and not any(f.done() for f in futures), most_waiting
                time.sleep(0.05)
            probes = []
            for _ in range(20):
                started = time.monotonic()
                health = requests.get(f"{hf_server.url}/health/", timeout=5)
                probes.append(time.monotonic() - started)
                assert health.status_code == 200
            assert waiting() == 64  # the probes ran while every call waited
            hf_server.step_gate.unlink()
            statuses = [f.result() for f in futures]
    finally:
        hf_server.step_gate.unlink(missing_ok=True)
    assert statuses == [200] * 64
    assert max(probes) < 1.0, max(probes)
    print(
        f"/health/ while up to {most_waiting} calls waited: {len(probes)} probes, slowest {max(probes):.3f}s"
    )


@pytest.mark.heavy
def test_hf_weight_pushes_under_load_are_fair_and_every_answer_has_the_right_version(
    hf_sync_server: Any, trainer_side: Callable[..., Any], raccoon_requests: list[Any]
) -> None:
    side = trainer_side(hf_sync_server.url)
    result = pushes_under_load(hf_sync_server, side, raccoon_requests, Decoding(max_new_tokens=24))
    check_load_result(result, "hf")


def test_an_engine_thread_that_fails_unexpectedly_fails_its_calls_and_health(
    in_process: Callable[..., RolloutServer], raccoon_requests: list[Any]
) -> None:
    server = in_process()
    prompts = prepared_prompts(server, raccoon_requests)

    def broken_admission() -> None:  # fault injection: a bug in the engine thread itself
        raise RuntimeError("injected engine-thread bug")

    server.scheduler._admit_pending = broken_admission  # type: ignore[method-assign]
    ticket = server.scheduler.submit(prompts[:1], GREEDY, 0)
    with pytest.raises(BackendError, match="injected engine-thread bug"):
        wait_for(server.scheduler, ticket)
    health = server.health()
    assert health.status == "broken" and health.engine == "stopped" and "injected" in (health.detail or "")
    with pytest.raises(BackendError, match="stopped"):
        server.scheduler.submit(prompts[:1], GREEDY, 0)
