"""A call whose waiter gave up because the engine stalled is gone from the server: it no longer holds
its prompts in the queue limits and is not generated once the engine recovers."""

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


def test_a_call_given_up_on_a_stall_leaves_the_queue_and_never_runs(
    hf_engine: Any, raccoon_requests: list[Any]
) -> None:
    server = RolloutServer(hf_engine, ServerLimits(engine_stall_timeout_s=1.0))
    release = threading.Event()
    added: list[str] = []
    add = server.engine.add
    server.engine.add = lambda request_id, *rest: added.append(request_id) or add(request_id, *rest)
    entered = threading.Event()

    def hold() -> None:  # the engine thread is inside the load until the test releases it
        entered.set()
        release.wait(60)

    def wedge() -> None:  # the pusher: told of the stall, or done once released
        try:
            server.scheduler.run_operation(WEIGHT_LOAD, hold, is_load=True)
        except BackendError:
            return

    wedged = threading.Thread(target=wedge, daemon=True)
    try:
        prompts = prepared_prompts(server, raccoon_requests)
        wedged.start()
        assert entered.wait(30), "the engine thread never started the load"
        given_up = server.scheduler.submit(prompts[:2], GREEDY, 0)
        with pytest.raises(BackendError, match="made no progress"):
            wait_for(server.scheduler, given_up)
        # Answered 503: the call is over for the server too, its prompts no longer count.
        depth = server.scheduler.depth()
        assert depth["queued_calls"] == 0 and depth["outstanding_prompts"] == 0, depth
        assert given_up.done.is_set() and "gave up" in str(given_up.error)
        release.set()
        wedged.join(timeout=30)
        deadline = time.monotonic() + 30  # the load returns at once when released; 30 s is >10x idle
        while server.health().status != "ok" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.health().status == "ok"
        after = server.scheduler.submit(prompts[:1], GREEDY, 1)  # the engine serves again
        assert len(wait_for(server.scheduler, after)) == 1
        assert not any(rid in added for rid in (given_up.request_id(0), given_up.request_id(1))), added
    finally:
        release.set()
        del server.engine.add
        server.scheduler.close()
        server.sync.shutdown()
