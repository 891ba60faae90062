"""A torchrun worker for the one-rank-failure test: ``rollmatch train`` where rank 1's data fails.

Fault injection only: on rank 1, building the GT targets raises from its ``FAIL_AFTER``-th call on
(a broken record that only one rank reads). Everything else is the real training entry point.
"""

from __future__ import annotations

import os
import sys

FAIL_AFTER = int(os.environ.get("ROLLMATCH_TEST_FAIL_AFTER", "3"))

if __name__ == "__main__":
    if os.environ.get("RANK") == "1":
        from rollmatch.training import segment_producers

        original = segment_producers.GTSegmentProducer.produce
        calls = [0]

        def produce(self, records, global_step):  # type: ignore[no-untyped-def]
            calls[0] += 1
            if calls[0] >= FAIL_AFTER:
                raise ValueError(f"a broken record in call {calls[0]} (injected on rank 1)")
            return original(self, records, global_step)

        segment_producers.GTSegmentProducer.produce = produce  # type: ignore[method-assign]
    from rollmatch.cli import main

    sys.exit(main(sys.argv[1:]))
