"""``rollmatch serve`` with a step gate the test controls from outside the process.

While the file named by ``$ROLLMATCH_TEST_STEP_GATE`` exists, the engine thread waits before each
engine step (the real step runs once the file is gone): a test holds calls in flight for as long
as it needs, whatever the machine's speed, by creating the file, and lets them go by removing it.
Everything else, the engine's generation included, is the real server process.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollmatch.server import engines

GATE_ENV = "ROLLMATCH_TEST_STEP_GATE"
HOLD_LIMIT_S = 300.0  # a test removes the file within seconds; this turns a forgotten one into an error


def _gated(step: Callable[[Any], Any], gate: Path) -> Callable[[Any], Any]:
    def gated_step(self: Any) -> Any:
        deadline = time.monotonic() + HOLD_LIMIT_S
        while gate.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"step gate {gate} held for {HOLD_LIMIT_S:g}s: the test never removed it")
            time.sleep(0.005)
        return step(self)

    return gated_step


if __name__ == "__main__":
    gate = Path(os.environ[GATE_ENV])
    for engine in (engines.HFServerEngine, engines.VllmServerEngine):
        engine.step = _gated(engine.step, gate)  # type: ignore[method-assign]
    from rollmatch.cli import main

    sys.exit(main(sys.argv[1:]))
