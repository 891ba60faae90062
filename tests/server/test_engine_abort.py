"""Abort, cancel and cache resets on a running HF generation (real HF engine on the tiny model, in
process). The generation is held at a decoding step by a gate the test controls (a forward hook),
so nothing races the clock.

Formerly an HF step generated whole responses: a client that left 0.5 s into a call of 8 x 1,500
tokens was still generated for 3 s and more, an abort-mode update waited for the step, and a
``/reset_prefix_cache/`` sent during the call answered after the call (4.4 s) although the HF
engine has no prefix cache. A reset needed only the API key, and past the drain timeout it aborted
calls regardless of ``--max-reruns``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from rollmatch.errors import BackendError
from rollmatch.protocol import InferBody, InferRequest, RequestConfig
from rollmatch.server.limits import ServerLimits
from rollmatch.server.rollout_server import RolloutServer

HOLD_AT_FORWARD = 3
MAX_TOKENS = 64
WAIT_S = 60.0


@dataclass
class ForwardGate:
    """Counts the model's forwards, holds the ``HOLD_AT_FORWARD``-th until :meth:`release`, and
    never lets the model pick EOS (so the call cannot end on its own before the test acts)."""

    eos: int
    forwards: int = 0
    reached: threading.Event = field(default_factory=threading.Event)
    go: threading.Event = field(default_factory=threading.Event)

    def __call__(self, module: Any, args: Any, output: Any) -> Any:
        self.forwards += 1
        output.logits[..., self.eos] = float("-inf")
        if self.forwards == HOLD_AT_FORWARD:
            self.reached.set()
            assert self.go.wait(WAIT_S), "the test never released the gate"
        return output

    def release(self) -> int:
        """Let generation go on; the forwards done so far."""
        done = self.forwards
        self.go.set()
        return done


@pytest.fixture
def gated(hf_engine: Any) -> Iterator[ForwardGate]:
    gate = ForwardGate(hf_engine.preparer.eos_token_id)
    handle = hf_engine.model.register_forward_hook(gate)
    yield gate
    gate.go.set()
    handle.remove()


@pytest.fixture
def make_server(hf_engine: Any) -> Iterator[Callable[..., RolloutServer]]:
    made: list[RolloutServer] = []

    def make(**limits: Any) -> RolloutServer:
        server = RolloutServer(hf_engine, ServerLimits(**limits))
        made.append(server)
        return server

    yield make
    for server in made:
        server.scheduler.close()
        server.sync.shutdown()


def _submit(server: RolloutServer, prompts: int = 2) -> Any:
    body = InferBody(
        infer_requests=[InferRequest(prompt_token_ids=[5 + i, 6, 7]) for i in range(prompts)],
        request_config=RequestConfig(max_tokens=MAX_TOKENS, seed=0),
    )
    with server.scheduler.arrival():
        return server.submit(server.prepare(body))


def test_a_cancel_ends_a_running_hf_generation_within_one_decoding_step(
    make_server: Callable[..., RolloutServer], gated: ForwardGate
) -> None:
    server = make_server()
    ticket = _submit(server)
    assert gated.reached.wait(WAIT_S), "generation never started"
    server.scheduler.cancel(ticket, "the client disconnected")
    held_at = gated.release()
    assert ticket.done.wait(WAIT_S)
    assert isinstance(ticket.error, BackendError) and "cancelled" in str(ticket.error)
    assert gated.forwards - held_at <= 1, f"{gated.forwards - held_at} forwards after the cancel"
    assert server.health().outstanding_prompts == 0


def test_an_abort_mode_update_stops_the_running_step_and_reruns_the_call(
    make_server: Callable[..., RolloutServer], gated: ForwardGate
) -> None:
    server = make_server(update_mode="abort")
    ticket = _submit(server)
    assert gated.reached.wait(WAIT_S)
    loaded = threading.Event()
    update = threading.Thread(
        target=lambda: server.scheduler.run_operation(
            "test load", lambda: loaded.set() and None, is_load=True
        )
    )
    update.start()
    hf = server.engine
    for _ in range(int(WAIT_S / 0.01)):  # the updater interrupts the running step as it queues
        if hf._interrupted or loaded.is_set():
            break
        threading.Event().wait(0.01)
    held_at = gated.release()
    assert loaded.wait(WAIT_S)
    after_load = gated.forwards
    assert after_load - held_at <= 1, f"{after_load - held_at} forwards before the abort-mode load"
    update.join(WAIT_S)
    assert ticket.done.wait(WAIT_S) and ticket.error is None and ticket.attempts == 1
    assert all(len(o.token_ids) == MAX_TOKENS for o in ticket.outputs), "a re-run answered a cut-short row"


def test_a_cache_reset_on_hf_is_a_no_op_during_a_call(
    make_server: Callable[..., RolloutServer], gated: ForwardGate
) -> None:
    server = make_server()
    ticket = _submit(server)
    assert gated.reached.wait(WAIT_S)
    reset = threading.Thread(target=lambda: asyncio.run(server.reset_prefix_cache()))
    reset.start()
    reset.join(2.0)
    finished = not reset.is_alive()
    gated.release()
    reset.join(WAIT_S)
    assert finished, "the reset waited for the call: HF has no prefix cache to reset"
    assert ticket.done.wait(WAIT_S) and ticket.error is None


def test_a_cache_reset_needs_the_lease_or_the_sync_key(
    hf_engine: Any, app_client: Callable[..., Any]
) -> None:
    client, _ = app_client(hf_engine, api_key="api-key-0123", sync_key="sync-key-0123")
    auth = {"Authorization": "Bearer api-key-0123"}
    assert client.post("/reset_prefix_cache/", headers=auth).status_code == 403
    wrong = {**auth, "X-Rollmatch-Sync-Lease": "not-the-lease"}
    assert client.post("/reset_prefix_cache/", headers=wrong).status_code == 409
    keyed = {**auth, "X-Rollmatch-Sync-Key": "sync-key-0123"}
    assert client.post("/reset_prefix_cache/", headers=keyed).status_code == 200


def test_an_operation_past_the_drain_timeout_waits_for_a_call_at_max_reruns(
    make_server: Callable[..., RolloutServer], gated: ForwardGate
) -> None:
    """A cache reset (any operation, not only a weight load) past the drain timeout used to abort
    the running calls whatever their re-runs: a reset loop re-ran long calls forever."""
    server = make_server(drain_timeout_s=0.01, max_reruns=0)
    ticket = _submit(server)
    assert gated.reached.wait(WAIT_S)
    ran = threading.Event()
    operation = threading.Thread(
        target=lambda: server.scheduler.run_operation("test reset", lambda: ran.set() and None, is_load=False)
    )
    operation.start()
    gated.release()
    operation.join(WAIT_S)
    assert ran.is_set() and ticket.done.wait(WAIT_S)
    assert ticket.error is None and ticket.attempts == 0, "the call was aborted past --max-reruns"
