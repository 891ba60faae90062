"""The receiver's leaf-by-leaf checksum is the bucket checksum: hashing each leaf as it lands
changes when the work is done, not what the digest covers."""

from __future__ import annotations

import torch

from rollmatch.sync.digest import (
    LEAF_BYTES,
    bucket_checksum,
    bucket_tag,
    leaf_spans,
    leaf_tag_async,
    new_digest_key,
)
from rollmatch.sync.weights import TensorMeta


def test_leaf_tags_combine_to_the_bucket_checksum_and_cover_every_byte() -> None:
    size = 2 * LEAF_BYTES + 12345  # two full leaves and a short one
    flat = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    metas = [TensorMeta("w", "uint8", (size,), 0, size)]
    key = new_digest_key()
    spans = leaf_spans(size)
    assert spans == [(0, LEAF_BYTES), (LEAF_BYTES, 2 * LEAF_BYTES), (2 * LEAF_BYTES, size)]
    leaves = [leaf_tag_async(key, a, flat[a:b]).result() for a, b in spans]
    assert bucket_tag(key, metas, size, leaves) == bucket_checksum(key, metas, flat)
    flat[size - 1] ^= 1  # the last byte of the short leaf
    changed = [leaf_tag_async(key, a, flat[a:b]).result() for a, b in spans]
    assert bucket_tag(key, metas, size, changed) != bucket_tag(key, metas, size, leaves)


def test_a_forked_child_of_a_process_that_hashed_still_hashes() -> None:
    """The hashing pool's threads do not survive a fork: a rank forked from a process that already
    pushed (a forked learner rank) hashes in a pool of its own instead of waiting forever."""
    import os
    import signal
    import time

    key = new_digest_key()
    flat = torch.arange(3 * LEAF_BYTES // 2, dtype=torch.int64).to(torch.uint8)
    metas = [TensorMeta("w", "uint8", (flat.numel(),), 0, flat.numel())]
    expected = bucket_checksum(key, metas, flat)  # the parent's pool has run: its threads exist here
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os._exit(0 if bucket_checksum(key, metas, flat) == expected else 1)
    deadline = time.monotonic() + 60  # a hash takes milliseconds; a child without a pool never ends
    while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
        time.sleep(0.02)
    if not done[0]:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert done[0] and os.waitstatus_to_exitcode(done[1]) == 0, "the forked child hung (or hashed wrongly)"
