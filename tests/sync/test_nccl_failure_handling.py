"""NCCL weight-sync groups under a dead server (the code paths CUDA runs; checked here with
fault-injected groups, since this machine has no NCCL): the group is built so that its errors raise on
the pushing rank (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` while it is constructed) instead of tearing the
learner down, and a group whose transfer failed is aborted, never shut down (``shutdown()`` waits for a
dead peer's pending work)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from rollmatch.collectives import LocalCollectives
from rollmatch.rollout.client import ServerBackend
from rollmatch.rollout.connection import ServerConnection
from rollmatch.sync import transport
from rollmatch.sync.transport import GroupTransport, nccl_errors_raise


class _RecordingGroup:
    def __init__(self, calls: list[str]):
        self.calls = calls

    def abort(self) -> None:
        self.calls.append("abort")

    def shutdown(self) -> None:
        self.calls.append("shutdown")


def test_a_failed_nccl_group_is_aborted_and_a_healthy_one_shut_down() -> None:
    calls: list[str] = []
    for abort in (True, False):
        group = GroupTransport.__new__(GroupTransport)  # its rendezvous needs two processes and CUDA
        group._group, group.backend, group._store = _RecordingGroup(calls), "nccl", None
        group.close(abort=abort)
        group.close(abort=abort)  # safe twice
    assert calls == ["abort", "shutdown"]


@pytest.mark.parametrize("before", [None, "3"])
def test_weight_sync_groups_are_built_with_errors_that_raise(
    monkeypatch: pytest.MonkeyPatch, before: Any
) -> None:
    env = transport.NCCL_ERROR_HANDLING_ENV
    if before is None:
        monkeypatch.delenv(env, raising=False)
    else:
        monkeypatch.setenv(env, before)
    with nccl_errors_raise():
        assert os.environ[env] == "2"
    assert os.environ.get(env) == before  # the learner's own groups keep the environment's setting


def test_the_client_aborts_the_groups_of_a_failed_push() -> None:
    closed: list[bool] = []

    class Transport:
        def close(self, *, abort: bool = False) -> None:
            closed.append(abort)

    backend = ServerBackend(
        [ServerConnection("http://127.0.0.1:1", 1, timeout_s=1.0, infer_timeout_s=None)],
        collectives=LocalCollectives(),
        tokenizer=None,
    )
    backend.pusher._transports = [Transport()]  # type: ignore[list-item]
    backend.pusher._groups_failed = True  # what a push that raised leaves behind
    backend.pusher._close_groups(notify=False)
    backend.pusher._transports = [Transport()]  # type: ignore[list-item]
    backend.pusher._close_groups(notify=False)  # the next groups closed normally
    assert closed == [True, False]
