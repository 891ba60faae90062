"""A rank's work in the push-failure test (run in ranks forked from the test process): every rank calls ``ServerBackend.sync_weights`` against a
real rollout server, and rank 0's push meets a fault that is not a ``RollmatchError``.

Fault injection only, on rank 0 (``ROLLMATCH_TEST_FAULT``): ``dns`` — the server's host no longer
resolves when the weight-sync group is formed (``socket.gaierror``); ``answer`` — the server answers
``/get_world_size/`` with something that is not a number (``ValueError``). Each rank writes
``{"outcome": ..., "seconds": ...}`` to ``<out>/rank<R>.json``: the error ``sync_weights`` raised there
and how long the call took. Rank 0 then waits (bounded) for rank 1's file, so no rank leaves early.

Usage: ``push_failure_worker.py MODEL_DIR SERVER_URL GROUP_PORT OUT_DIR COLLECTIVE_TIMEOUT_S``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path


def inject(fault: str) -> None:
    from rollmatch.rollout import weight_push
    from rollmatch.rollout.connection import ServerConnection

    if fault == "dns":

        def unresolvable(host: str) -> str:
            raise socket.gaierror(socket.EAI_NONAME, f"Name or service not known: {host} (injected)")

        weight_push.socket.gethostbyname = unresolvable  # type: ignore[attr-defined]
    elif fault == "answer":
        real_get = ServerConnection.get

        def get(self, path, phase):  # type: ignore[no-untyped-def]
            if path == "/get_world_size/":
                return {"world_size": "many (injected)"}
            return real_get(self, path, phase)

        ServerConnection.get = get  # type: ignore[method-assign]
    else:
        raise ValueError(f"unknown fault {fault!r}")


def main(model_dir: str, url: str, group_port: int, out: Path, timeout_s: float) -> None:
    from transformers import AutoModelForImageTextToText

    from rollmatch.collectives import TorchCollectives, init_default_group
    from rollmatch.rollout.client import ServerBackend
    from rollmatch.rollout.connection import ServerConnection

    init_default_group(timeout_s)
    collectives = TorchCollectives(timeout_s)
    rank = collectives.rank
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    connection = ServerConnection(url, group_port, timeout_s=20.0, infer_timeout_s=None)
    backend = ServerBackend([connection], collectives=collectives, tokenizer=None)
    if rank == 0:
        inject(os.environ["ROLLMATCH_TEST_FAULT"])
    collectives.barrier("both ranks ready")
    started = time.monotonic()
    try:
        backend.sync_weights(model, 1)
        outcome = "no error"
    except Exception as exc:  # the outcome is what the test checks
        outcome = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - started
    (out / f"rank{rank}.json").write_text(json.dumps({"outcome": outcome, "seconds": seconds}))
    if rank == 0:
        deadline = time.monotonic() + 2 * timeout_s
        while not (out / "rank1.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    os._exit(0)  # no process-group teardown: a rank left in a collective must not hang the other


if __name__ == "__main__":
    model_dir, url, port, out, timeout = sys.argv[1:6]
    main(model_dir, url, int(port), Path(out), float(timeout))
