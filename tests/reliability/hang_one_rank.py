"""A torchrun worker for the hung-rank test: ``rollmatch train`` where rank 1 hangs inside a step.

Fault injection only: on rank 1 the model's forward blocks forever from its ``HANG_AFTER``-th call
on (a peer that is stuck, not dead). Everything else is the real training entry point.
"""

from __future__ import annotations

import os
import sys
import threading

import transformers

HANG_AFTER = int(os.environ.get("ROLLMATCH_TEST_HANG_AFTER", "3"))


def _hanging_loader(original):  # type: ignore[no-untyped-def]
    def load(*args, **kwargs):  # type: ignore[no-untyped-def]
        model = original(*args, **kwargs)
        calls = [0]

        def hang(*_):  # type: ignore[no-untyped-def]
            calls[0] += 1
            if calls[0] >= HANG_AFTER:
                print(f"rank 1: hanging in forward call {calls[0]}", flush=True)
                threading.Event().wait()  # forever

        model.register_forward_pre_hook(hang)
        return model

    return load


if __name__ == "__main__":
    import faulthandler

    if os.environ.get("ROLLMATCH_TEST_DUMP_AFTER"):
        faulthandler.dump_traceback_later(float(os.environ["ROLLMATCH_TEST_DUMP_AFTER"]), exit=False)
    if os.environ.get("RANK") == "1":
        auto = transformers.AutoModelForImageTextToText
        auto.from_pretrained = _hanging_loader(auto.from_pretrained)  # type: ignore[method-assign]
    from rollmatch.cli import main

    sys.exit(main(sys.argv[1:]))
