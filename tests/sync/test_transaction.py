"""The weight-update transaction, both halves in one process (in-process group, direct channel)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rollmatch.errors import BackendError, ServerPushFailed, SyncError
from rollmatch.protocol import (
    FinishUpdateBody,
    FinishUpdateReply,
    TransactionHeader,
    UpdateFlattenedParamsBody,
    WireModel,
)
from rollmatch.sync.digest import LEAF_BYTES, bucket_checksum, new_digest_key
from rollmatch.sync.transaction import PushResult, UpdateReceiver, VerifiedUpdate, push_update
from rollmatch.sync.transport import LocalTransport, PendingTransfer
from rollmatch.sync.weights import TensorMeta

KEY = bytes(range(32))  # the digest key both halves got at init (fixed: tests reproduce)


class DirectChannel:
    """The receiver's endpoints called directly (what the server does behind HTTP)."""

    url = "in-process://receiver"

    def __init__(self, receiver: UpdateReceiver, tamper_reply: bool = False):
        self.receiver = receiver
        self.tamper_reply = tamper_reply
        self.applied: list[VerifiedUpdate] = []

    def post(self, path: str, body: WireModel | None, phase: str) -> dict[str, Any]:
        if path == "/update_flattened_params/":
            assert isinstance(body, UpdateFlattenedParamsBody) and body.transaction is not None
            self.receiver.receive_bucket(body.transaction, body.metadatas)
            return {}
        assert path == "/finish_weight_update/" and isinstance(body, FinishUpdateBody)
        try:
            update = self.receiver.finish(body)
        except SyncError as exc:
            return FinishUpdateReply(
                ok=False,
                version=-1,
                checksum="",
                bucket_checksums=[],
                num_bytes=0,
                num_tensors=0,
                error=str(exc),
            ).model_dump()
        self.applied.append(update)
        reply = update.reply.model_dump()
        if self.tamper_reply:
            reply["checksum"] = "0" * 16
        return reply


class CorruptingTransport:
    """Alters the ``corrupt_call``-th broadcast after the sender computed its checksums: flips its last
    byte, or (``compensating``) adds 1 to one 64-bit word and subtracts 1 from the next, which leaves
    every sum of words (and a chunk-position-weighted sum) unchanged."""

    def __init__(self, inner: LocalTransport, corrupt_call: int, compensating: bool = False):
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size
        self.corrupt_call, self.calls, self.compensating = corrupt_call, 0, compensating

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> PendingTransfer:
        if self.calls == self.corrupt_call:
            tensor = tensor.clone()
            if self.compensating:
                words = tensor[: tensor.numel() // 8 * 8].view(torch.int64)
                words[0] += 1
                words[1] -= 1
            else:
                tensor[-1] ^= 0xFF
        self.calls += 1
        return self.inner.broadcast_async(tensor, src)

    def broadcast(self, tensor: torch.Tensor, src: int, phase: str) -> None:
        self.broadcast_async(tensor, src).wait(phase)

    def close(self) -> None:
        return None


def _tensors() -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    return [
        ("model.embed.weight", torch.randn(64, 16)),
        ("model.layer.bias", torch.randn(16).to(torch.bfloat16)),
        ("model.layer.weight", torch.randn(16, 16)),
        ("lm_head.weight", torch.randn(64, 16)),
    ]


def _pair(key: bytes = KEY) -> tuple[LocalTransport, UpdateReceiver]:
    server_side, trainer_side = LocalTransport.group(2, timeout_s=5)
    return trainer_side, UpdateReceiver(server_side, source_rank=1, digest_key=key)


def test_update_arrives_exactly_in_several_buckets() -> None:
    trainer, receiver = _pair()
    channel = DirectChannel(receiver)
    result = push_update(
        [(channel, trainer)], _tensors(), version=3, mode="full", digest_key=KEY, bucket_bytes=4096
    )
    assert isinstance(result, PushResult) and result.version == 3 and result.num_tensors == 4
    (update,) = channel.applied
    assert len(update.reply.bucket_checksums) == 3  # 4 KiB | 32 B + 1 KiB | 4 KiB
    assert update.reply.checksum == result.checksum and update.version == 3
    for (name, sent), (got_name, got) in zip(_tensors(), update.tensors, strict=True):
        assert name == got_name and got.dtype == sent.dtype and torch.equal(got, sent)


def test_corruption_in_transit_is_detected_and_nothing_is_applied() -> None:
    trainer, receiver = _pair()
    channel = DirectChannel(receiver)
    corrupting = CorruptingTransport(trainer, corrupt_call=1)
    with pytest.raises(
        SyncError,
        match=r"rejected weight version 4: .*checksum mismatch in bucket 1 \(model.layer.bias, model.layer.weight\)",
    ):
        push_update(
            [(channel, corrupting)], _tensors(), version=4, mode="full", digest_key=KEY, bucket_bytes=4096
        )
    assert channel.applied == []
    # the staging was dropped; the next clean update goes through
    push_update([(channel, trainer)], _tensors(), version=4, mode="full", digest_key=KEY, bucket_bytes=4096)
    assert [u.version for u in channel.applied] == [4]


def test_sender_rejects_an_acknowledgement_with_another_checksum() -> None:
    trainer, receiver = _pair()
    with pytest.raises(SyncError, match="not trustworthy"):
        push_update(
            [(DirectChannel(receiver, tamper_reply=True), trainer)],
            _tensors(),
            version=1,
            mode="full",
            digest_key=KEY,
        )


def test_every_receiver_gets_the_same_update() -> None:
    (trainer_a, receiver_a), (trainer_b, receiver_b) = _pair(), _pair()  # one private group per server
    channels = [DirectChannel(receiver_a), DirectChannel(receiver_b)]
    targets = list(zip(channels, [trainer_a, trainer_b], strict=True))
    push_update(targets, _tensors(), version=2, mode="full", digest_key=KEY)
    assert channels[0].applied[0].reply.checksum == channels[1].applied[0].reply.checksum


def test_a_receivers_failure_names_that_receiver_and_the_phase() -> None:
    """Two receivers; the second's transfer is corrupted (its finish is refused) or its announcement
    fails: the error is a ``ServerPushFailed`` carrying the second's URL and the phase, whatever URLs
    its text quotes."""
    (trainer_a, receiver_a), (trainer_b, receiver_b) = _pair(), _pair()
    first, second = DirectChannel(receiver_a), DirectChannel(receiver_b)
    first.url, second.url = "http://first:1", "http://second:2"
    corrupting = CorruptingTransport(trainer_b, corrupt_call=0)
    with pytest.raises(ServerPushFailed) as refused:
        push_update(
            [(first, trainer_a), (second, corrupting)], _tensors(), version=1, mode="full", digest_key=KEY
        )
    assert (refused.value.url, refused.value.phase, refused.value.refused) == (
        "http://second:2",
        "finish",
        True,
    )
    assert str(refused.value).startswith(
        "rollout server http://second:2: finishing the weight version failed: "
    )

    class FailingChannel(DirectChannel):
        def post(self, path: str, body: WireModel | None, phase: str) -> dict[str, Any]:
            raise BackendError(f"{phase}: upstream http://first:1 did not answer (injected)")

    failing = FailingChannel(_pair()[1])
    failing.url = "http://second:2"
    with pytest.raises(ServerPushFailed) as down:
        push_update(
            [(first, trainer_a), (failing, trainer_b)], _tensors(), version=2, mode="full", digest_key=KEY
        )
    assert (down.value.url, down.value.phase, down.value.refused) == ("http://second:2", "announce", False)
    assert isinstance(down.value.cause, BackendError) and down.value.__cause__ is down.value.cause


def test_receiver_rejects_out_of_order_buckets_and_unmatched_finish() -> None:
    _, receiver = _pair()
    header = TransactionHeader(version=1, mode="full", bucket_index=1, num_bytes=16)
    with pytest.raises(SyncError, match="without its bucket 0"):
        receiver.receive_bucket(header, [])
    finish = FinishUpdateBody(version=1, mode="full", bucket_checksums=["x"], checksum="y")
    with pytest.raises(SyncError, match="the staged update is nothing"):
        receiver.finish(finish)


def test_an_empty_update_is_an_error() -> None:
    trainer, receiver = _pair()
    with pytest.raises(SyncError, match="has no tensors"):
        push_update([(DirectChannel(receiver), trainer)], [], version=1, mode="full", digest_key=KEY)


def test_compensating_word_changes_in_transit_are_detected() -> None:
    """A sum of words (the checksum before keyed digests) cannot see +1 / -1 on two words of one
    chunk; the keyed MAC must."""
    trainer, receiver = _pair()
    channel = DirectChannel(receiver)
    tampering = CorruptingTransport(trainer, corrupt_call=0, compensating=True)
    with pytest.raises(SyncError, match=r"checksum mismatch in bucket 0"):
        push_update(
            [(channel, tampering)], _tensors(), version=5, mode="full", digest_key=KEY, bucket_bytes=4096
        )
    assert channel.applied == []


def test_a_receiver_with_another_digest_key_accepts_nothing() -> None:
    trainer, receiver = _pair(key=new_digest_key())
    channel = DirectChannel(receiver)
    with pytest.raises(SyncError, match=r"checksum mismatch in bucket 0"):
        push_update([(channel, trainer)], _tensors(), version=1, mode="full", digest_key=KEY)
    assert channel.applied == []


def test_bucket_checksum_sees_flips_moved_leaves_length_layout_and_key() -> None:
    data = torch.randint(
        0, 256, (2 * LEAF_BYTES + 5,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    metas = [TensorMeta("w", "uint8", (data.numel(),), 0, data.numel())]
    digest = bucket_checksum(KEY, metas, data)
    assert len(digest) == 32 and bucket_checksum(KEY, metas, data.clone()) == digest
    flipped = data.clone()
    flipped[LEAF_BYTES + 123] ^= 0x10
    swapped = data.clone()
    swapped[:LEAF_BYTES], swapped[LEAF_BYTES : 2 * LEAF_BYTES] = (
        data[LEAF_BYTES : 2 * LEAF_BYTES],
        data[:LEAF_BYTES],
    )
    compensated = data.clone()
    words = compensated[:16].view(torch.int64)
    words[0] += 1
    words[1] -= 1
    variants = {
        bucket_checksum(KEY, metas, flipped),
        bucket_checksum(KEY, metas, swapped),
        bucket_checksum(KEY, metas, compensated),
        bucket_checksum(KEY, [TensorMeta("v", "uint8", (data.numel(),), 0, data.numel())], data),
        bucket_checksum(new_digest_key(), metas, data),
        digest,
    }
    assert len(variants) == 6
    assert bucket_checksum(KEY, metas, data[:-1]) != digest


def test_the_senders_leaf_by_leaf_digest_while_packing_equals_the_bucket_checksum() -> None:
    # The sender digests each leaf as soon as packing wrote it (leaves that end mid-tensor, a tensor
    # spanning several leaves, padding, a short last leaf); its checksums must be the reference
    # tree's, computed on the finished buckets.
    from rollmatch.sync.digest import combine_checksums
    from rollmatch.sync.weights import flatten_buckets

    torch.manual_seed(1)
    tensors = [
        ("a", torch.randn(LEAF_BYTES // 4 + 3)),  # ends 12 bytes into the second leaf (+ 4 padding)
        ("b", torch.randn(5).to(torch.bfloat16)),
        ("c", torch.randn(2 * LEAF_BYTES // 4 + 1000)),  # spans three leaves
        ("d", torch.randn(LEAF_BYTES // 4)),  # the next bucket: exactly one leaf
    ]
    bucket_bytes = 4 * LEAF_BYTES
    trainer, receiver = _pair()
    result = push_update(
        [(DirectChannel(receiver), trainer)],
        tensors,
        version=7,
        mode="full",
        digest_key=KEY,
        bucket_bytes=bucket_bytes,
    )
    expected = [bucket_checksum(KEY, b.metas, b.flat) for b in flatten_buckets(tensors, bucket_bytes)]
    assert len(expected) == 2
    assert result.replies[0].bucket_checksums == expected
    assert result.checksum == combine_checksums(KEY, 7, "full", expected)
