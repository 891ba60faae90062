"""The engine thread's states under faults (real HF engine on the tiny model, in process; faults
injected into it): a half-applied load breaks the scheduler until a complete load, cache resets
coalesce without holding worker threads, and a client that leaves cancels its call."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from load_clients import prepared_prompts, wait_for

from rollmatch.errors import BackendError, SyncError
from rollmatch.protocol import FinishUpdateBody, FinishUpdateReply, InferRequest, encode_image
from rollmatch.rollout.types import Decoding
from rollmatch.server.engine_watch import WEIGHT_LOAD
from rollmatch.server.engines import HFServerEngine
from rollmatch.server.limits import ServerLimits
from rollmatch.server.rollout_server import RolloutServer
from rollmatch.sync.transaction import VerifiedUpdate

GREEDY = Decoding(max_new_tokens=4)


@pytest.fixture(scope="module")
def own_engine(tiny_model_dir: Path) -> HFServerEngine:
    """An HF engine this module may load weights into (the shared ``hf_engine`` must stay pristine)."""
    return HFServerEngine(str(tiny_model_dir), max_model_len=1024)


@pytest.fixture
def server(own_engine: HFServerEngine) -> Iterator[RolloutServer]:
    made = RolloutServer(own_engine, ServerLimits())
    yield made
    made.scheduler.close()
    made.sync.shutdown()


def _push(server: RolloutServer, tensors: list[tuple[str, torch.Tensor]], version: int) -> FinishUpdateReply:
    """``/finish_weight_update/``'s behaviour on a verified update (the gloo transfer is not under test)."""
    reply = FinishUpdateReply(
        ok=True, version=version, checksum="c", bucket_checksums=["c"], num_bytes=0, num_tensors=len(tensors)
    )
    update = VerifiedUpdate(version, "full", tensors, None, reply)
    server.sync.finish = lambda body, lease, load: load(update)  # type: ignore[method-assign]
    body = FinishUpdateBody(version=version, mode="full", bucket_checksums=["c"], checksum="c")
    return server.finish_update(body, None)


def test_a_half_applied_load_fails_queued_calls_and_serves_again_only_after_a_complete_load(
    server: RolloutServer,
    own_engine: HFServerEngine,
    raccoon_requests: list[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Pins: calls queued behind a load that fails half-way are never admitted on the unknown weights
    # (before, they ran and were answered 200 with the old version); new calls get a 503 naming the
    # cause; a complete load serves again under its version.
    prompts = prepared_prompts(server, raccoon_requests[:1])
    pristine = [(k, v.detach().clone()) for k, v in own_engine.model.state_dict().items()]
    reference = wait_for(server.scheduler, server.scheduler.submit(prompts, GREEDY, 0))[0].token_ids
    loading, release = threading.Event(), threading.Event()
    real_load = own_engine.load_weights

    def half_applied(tensors: list[tuple[str, torch.Tensor]]) -> None:  # fault: copies, then fails
        real_load(tensors)
        loading.set()
        release.wait(30)
        raise RuntimeError("injected device error mid-load")

    monkeypatch.setattr(own_engine, "load_weights", half_applied)
    moved = [(k, v + 0.5) for k, v in pristine]
    errors: list[BaseException] = []
    pusher = threading.Thread(target=lambda: _catch(errors, lambda: _push(server, moved, 1)), daemon=True)
    pusher.start()
    assert loading.wait(30)
    queued = [server.scheduler.submit(prompts, GREEDY, i) for i in range(3)]  # wait behind the load
    release.set()
    pusher.join(30)
    assert errors and "failed half-way" in str(errors[0]) and "injected device error" in str(errors[0])
    for ticket in queued:
        with pytest.raises(BackendError, match="stopped serving: loading weight version 1 failed half-way"):
            wait_for(server.scheduler, ticket)
    health = server.health()
    assert health.status == "broken" and health.engine == "broken" and "half-way" in (health.detail or "")
    with pytest.raises(BackendError, match=r"stopped serving.*complete weight update"):
        server.scheduler.submit(prompts, GREEDY, 0)
    monkeypatch.setattr(own_engine, "load_weights", real_load)
    assert _push(server, pristine, 2).version == 2
    assert server.health().status == "ok"
    ticket = server.scheduler.submit(prompts, GREEDY, 0)
    assert wait_for(server.scheduler, ticket)[0].token_ids == reference and ticket.versions == (2, 2)


def _catch(errors: list[BaseException], fn: Callable[[], Any]) -> None:
    try:
        fn()
    except BaseException as exc:
        errors.append(exc)


def test_concurrent_resets_coalesce_hold_no_worker_thread_and_skip_when_nothing_changed(
    hf_engine: Any, app_client: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pins: 50 resets at once run the engine's reset once (before: 50 exclusive drains), never hold
    # the 40 worker threads a sync route needs (before: /get_world_size/ waited for all of them),
    # and a reset with nothing generated since the last one is a no-op.
    client, server = app_client(hf_engine)
    resets: list[float] = []
    real_reset = hf_engine.reset_caches
    monkeypatch.setattr(hf_engine, "has_prefix_cache", True)  # as vLLM: resets drain (HF's are no-ops)
    monkeypatch.setattr(hf_engine, "reset_caches", lambda: resets.append(time.monotonic()) or real_reset())
    release = threading.Event()
    wedge = threading.Thread(  # an engine operation in progress: resets must wait behind it
        target=lambda: server.scheduler.run_operation(
            "test wedge", lambda: release.wait(30) and None, is_load=False
        ),
        daemon=True,
    )
    with client:  # one event loop (and one 40-thread pool) for every request, as under uvicorn
        wedge.start()
        statuses: list[int] = []
        callers = [
            threading.Thread(target=lambda: statuses.append(client.post("/reset_prefix_cache/").status_code))
            for _ in range(50)
        ]
        try:
            for caller in callers:
                caller.start()
            deadline = time.monotonic() + 10
            while server.health().pending_operations < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # every reset request reached the app
            probe: list[int] = []
            prober = threading.Thread(target=lambda: probe.append(client.get("/get_world_size/").status_code))
            prober.start()
            prober.join(5.0)
            assert probe == [200], "a sync route waited for a worker thread while resets waited"
        finally:
            release.set()
            wedge.join(10)
            for caller in callers:
                caller.join(30)
        assert statuses == [200] * 50
        assert len(resets) == 1, f"{len(resets)} engine resets for 50 concurrent requests"
        assert client.post("/reset_prefix_cache/").status_code == 200
        assert len(resets) == 1  # nothing generated since: no drain, no reset
        good = {
            "infer_requests": [{"messages": [{"role": "user", "content": "hi"}]}],
            "request_config": {"max_tokens": 2},
        }
        assert client.post("/infer/", json=good).status_code == 200
        assert client.post("/reset_prefix_cache/").status_code == 200
        assert len(resets) == 2


@pytest.fixture
def live_app(hf_engine: Any, free_port: Callable[[], int]) -> Iterator[tuple[str, RolloutServer]]:
    """The real app on uvicorn (the server's h11 protocol) in this process: ``(url, server)``."""
    import uvicorn

    from rollmatch.server.app import build_app
    from rollmatch.server.connections import guarded_h11_protocol

    server = RolloutServer(hf_engine, ServerLimits())
    limits = server.limits
    port = free_port()
    config = uvicorn.Config(
        build_app(server),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        http=guarded_h11_protocol(limits.request_read_timeout_s, limits.max_connections),
    )
    runner = uvicorn.Server(config)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not runner.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", server
    runner.should_exit = True
    thread.join(15)
    server.scheduler.close()
    server.sync.shutdown()


def test_a_client_that_leaves_cancels_its_call_and_frees_its_prompts_and_pixels(
    live_app: tuple[str, RolloutServer], raccoon_requests: list[Any]
) -> None:
    # Pins: a call whose client disconnected while it queued is dropped within a poll or two,
    # releasing its admission (prompts) and its decoded pixels (before: it stayed queued, then ran).
    # (A running call is cancelled by the engine thread: see test_update_modes.py, on vLLM.)
    url, server = live_app
    request = raccoon_requests[0]
    wire = InferRequest(
        prompt_token_ids=list(request.prompt_token_ids), images=[encode_image(i) for i in request.images]
    )

    def body(max_tokens: int) -> dict[str, Any]:
        return {
            "infer_requests": [wire.model_dump(exclude_none=True)],
            "request_config": {"max_tokens": max_tokens, "seed": 0},
        }

    release = threading.Event()
    wedge = threading.Thread(  # an engine operation in progress: calls queue behind it
        target=lambda: server.scheduler.run_operation(
            "test wedge", lambda: release.wait(60) and None, is_load=False
        ),
        daemon=True,
    )
    wedge.start()
    try:
        with pytest.raises(requests.exceptions.ReadTimeout):  # the call queues, then its client leaves
            requests.post(f"{url}/infer/", json=body(4), timeout=2.0)
        left = time.monotonic()
        while server.health().queued_calls and time.monotonic() - left < 5:
            time.sleep(0.05)
        health = server.health()
        assert health.pending_operations == 1, "the wedge ended before the check"
        assert health.queued_calls == 0 and health.outstanding_prompts == 0, health
        assert server.pixels.held == 0
    finally:
        release.set()
        wedge.join(30)
    assert requests.post(f"{url}/infer/", json=body(4), timeout=60).status_code == 200


def test_a_full_update_missing_weights_is_refused_and_the_version_kept(
    server: RolloutServer, own_engine: HFServerEngine
) -> None:
    # Pins: a "full" update must carry every weight (before: a partial one loaded and was labelled
    # with the new version, serving a mix of two versions); refused cleanly, before any change.
    state = [(k, v.detach().clone()) for k, v in own_engine.model.state_dict().items()]
    with pytest.raises(SyncError, match=f"3 missing: .*{state[-1][0]}") as refused:  # sync.finish: ok=False
        _push(server, [(k, v + 1.0) for k, v in state[:-3]], 7)
    assert "whole model" in str(refused.value)
    assert all(torch.equal(v, own_engine.model.state_dict()[k]) for k, v in state)
    assert server.health().status == "ok" and server.weight_version == 0


def test_a_weight_load_ticks_the_watchdog_per_tensor(own_engine: HFServerEngine) -> None:
    # Pins: a load reports progress per tensor, so a load longer than --engine-stall-timeout-s that
    # is still copying is not reported stalled (before: no progress until it finished).
    ticks: list[int] = []
    own_engine.observe_progress(lambda: ticks.append(1))
    state = [(k, v.detach().clone()) for k, v in own_engine.model.state_dict().items()]
    own_engine.load_weights(state)
    assert len(ticks) == len(state)


def test_an_hf_weight_update_waits_for_one_capped_step_not_for_a_whole_big_call(
    own_engine: HFServerEngine, raccoon_requests: list[Any]
) -> None:
    # Pins: an HF step runs at most max_step_prompts prompts, so an update (a drain timeout shorter
    # than any step) aborts a big call at the next step boundary and re-runs it (before: one step ran
    # the whole call, and the update waited for all of it whatever --drain-timeout-s said). Three
    # steps' worth of prompts: the update lands before the last step however fast the machine is.
    server = RolloutServer(own_engine, ServerLimits(drain_timeout_s=0.01))
    try:
        prompts = prepared_prompts(server, raccoon_requests[:1]) * (3 * own_engine.max_step_prompts)
        ticket = server.scheduler.submit(prompts, GREEDY, 0)
        deadline = time.monotonic() + 30
        while server.health().running_calls == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        server.scheduler.run_operation(WEIGHT_LOAD, lambda: 1, is_load=True)
        assert not ticket.done.is_set(), "the update waited for the whole call"
        assert len(wait_for(server.scheduler, ticket)) == len(prompts)
        assert ticket.versions == (1, 1) and ticket.attempts == 1
    finally:
        server.scheduler.close()
        server.sync.shutdown()
