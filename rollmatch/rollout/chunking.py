"""How a batch of rollout requests is split over servers, and how each chunk is seeded (pure).

Owns: :func:`contiguous_chunks` (stable contiguous chunks of ``ceil(N / S)`` requests: server ``i``
gets ``[i * chunk, (i + 1) * chunk)``, clipped to ``N``, possibly empty) and the seeds:
:func:`step_seed` (one per training seed and optimizer step) and :func:`chunk_seed`
(``step_seed + chunk_start``). Inside a chunk, request ``j`` samples with ``chunk_seed + j``, so
request ``i`` of the batch always gets ``step_seed + i``: the same samples for any number of
servers, and the same seeds the colocated vLLM backend uses for a ``seed`` of ``step_seed``.
"""

from __future__ import annotations

import hashlib
import math

_SEED_SPACE = 1 << 31


def contiguous_chunks(n: int, num_servers: int) -> list[tuple[int, int]]:
    """``num_servers`` half-open ranges ``(start, end)`` covering ``range(n)`` in order (some may be empty)."""
    if n < 0 or num_servers <= 0:
        raise ValueError(f"need n >= 0 and num_servers > 0, got n={n}, num_servers={num_servers}")
    size = math.ceil(n / num_servers)
    return [(min(i * size, n), min((i + 1) * size, n)) for i in range(num_servers)]


def step_seed(training_seed: int, global_step: int) -> int:
    """A well-mixed seed in ``[0, 2**31)`` for one optimizer step of one run."""
    digest = hashlib.sha256(f"rollmatch-rollout:{int(training_seed)}:{int(global_step)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % _SEED_SPACE


def chunk_seed(training_seed: int, global_step: int, chunk_start: int) -> int:
    """The ``RequestConfig.seed`` of the chunk starting at request ``chunk_start`` of that step."""
    return step_seed(training_seed, global_step) + int(chunk_start)
