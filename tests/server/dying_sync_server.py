"""``rollmatch serve`` that dies in the middle of a weight push (fault injection for the failover tests).

The process takes bucket 0 of every update like the real server (the real ``SyncSession.receive_bucket``
runs: the bucket is received over the group and staged), and exits hard (``os._exit``, as a killed
process would: no reply, no teardown, the group's sockets closed by the kernel) at the next step of
that push: bucket 1 when the push has several buckets, else ``/finish_weight_update/`` (before the
update is verified or loaded). Everything else is the real server process.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from rollmatch.server import sync_session

EXIT_CODE = 9
_real_receive = sync_session.SyncSession.receive_bucket


def _die(what: str) -> None:
    print(f"dying mid-push: {what} arrived", flush=True)
    os._exit(EXIT_CODE)


def _receive_then_die(self: Any, body: Any, lease: str | None) -> None:
    if body.transaction is not None and body.transaction.bucket_index >= 1:
        _die(f"bucket {body.transaction.bucket_index}")
    _real_receive(self, body, lease)


def _finish_then_die(self: Any, *args: Any, **kwargs: Any) -> None:
    _die("finish")


if __name__ == "__main__":
    sync_session.SyncSession.receive_bucket = _receive_then_die  # type: ignore[method-assign]
    sync_session.SyncSession.finish = _finish_then_die  # type: ignore[method-assign]
    from rollmatch.cli import main

    sys.exit(main(sys.argv[1:]))
