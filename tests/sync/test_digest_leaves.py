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
