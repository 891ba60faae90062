"""A ``keep``-mode load leaves its cache reset for when the kept calls finish; if that reset fails,
the server is *broken* (nothing served until the next complete load, which heals it), as when the
reset right after a load fails, not stopped for good."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from load_clients import prepared_prompts, wait_for

from rollmatch.errors import BackendError
from rollmatch.rollout.types import Decoding
from rollmatch.server.engine_watch import WEIGHT_LOAD
from rollmatch.server.limits import ServerLimits
from rollmatch.server.rollout_server import RolloutServer

GREEDY = Decoding(max_new_tokens=4)
LIMIT_S = 60.0  # every wait below is for an event the test causes; this only turns a hang into an error


def _until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + LIMIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_failed_reset_after_a_kept_load_marks_the_server_broken_and_the_next_load_heals_it(
    hf_engine: Any, raccoon_requests: list[Any]
) -> None:
    server = RolloutServer(hf_engine, ServerLimits(update_mode="keep"))
    scheduler, engine = server.scheduler, server.engine
    in_step, release, reset_tried = threading.Event(), threading.Event(), threading.Event()

    def held_step() -> list[Any]:  # the call stays in flight (no output) until the test releases it
        in_step.set()
        release.wait(LIMIT_S)
        return []

    def failing_reset() -> None:  # the injected fault
        reset_tried.set()
        raise RuntimeError("injected cache-reset failure")

    engine.step = held_step
    try:
        prompts = prepared_prompts(server, raccoon_requests[:1])
        ticket = scheduler.submit(prompts, GREEDY, 0)
        assert in_step.wait(LIMIT_S), "the call never reached the engine"
        loader = threading.Thread(
            target=scheduler.run_operation,
            args=(WEIGHT_LOAD, lambda: 7),
            kwargs={"is_load": True},
            daemon=True,
        )
        loader.start()
        _until(lambda: scheduler.depth()["pending_operations"] == 1, "the load was never queued")
        engine.reset_caches = failing_reset
        del engine.step  # the real step from here on
        release.set()
        loader.join(LIMIT_S)
        assert not loader.is_alive() and scheduler.version == 7  # kept: loaded beside the running call
        assert len(wait_for(scheduler, ticket)) == 1  # the kept call finishes, then the reset is due
        waiting = scheduler.submit(prompts, GREEDY, 1)  # the reset runs before the next admission
        with pytest.raises(BackendError, match="stopped serving"):
            wait_for(scheduler, waiting)
        assert reset_tried.is_set()
        assert scheduler.state == "broken" and scheduler.stopped is None, scheduler.state
        assert "resetting the engine's caches failed" in (scheduler.broken or "")
        del engine.reset_caches  # the next complete load resets again and heals
        scheduler.run_operation(WEIGHT_LOAD, lambda: 8, is_load=True)
        assert scheduler.state == "idle" and scheduler.version == 8
        assert len(wait_for(scheduler, scheduler.submit(prompts, GREEDY, 2))) == 1
    finally:
        release.set()
        for name in ("step", "reset_caches"):
            engine.__dict__.pop(name, None)
        scheduler.close()
        server.sync.shutdown()
