"""``rollmatch serve`` whose engine never returns from ``step`` (fault injection for the SIGTERM test).

Everything but the engine's generation is the real server process.
"""

from __future__ import annotations

import sys
import threading

from rollmatch.server import engines


def _wedged(*_: object, **__: object) -> list[object]:
    print("engine: step entered and wedged", flush=True)
    while True:  # spins like the wedged vLLM engine did, ignoring everything
        threading.Event().wait(0.01)


if __name__ == "__main__":
    engines.HFServerEngine.step = _wedged  # type: ignore[method-assign,assignment]
    from rollmatch.cli import main

    sys.exit(main(sys.argv[1:]))
