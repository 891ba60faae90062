"""The weight-update transaction, both halves in one process (in-process group, direct channel)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rollmatch.errors import SyncError
from rollmatch.protocol import (
    FinishUpdateBody,
    FinishUpdateReply,
    TransactionHeader,
    UpdateFlattenedParamsBody,
    WireModel,
)
from rollmatch.sync.transaction import PushResult, UpdateReceiver, VerifiedUpdate, content_digest, push_update
from rollmatch.sync.transport import LocalTransport, PendingTransfer


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
    """Flips one byte of the ``corrupt_call``-th broadcast after the sender computed its checksums."""

    def __init__(self, inner: LocalTransport, corrupt_call: int):
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size
        self.corrupt_call, self.calls = corrupt_call, 0

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> PendingTransfer:
        if self.calls == self.corrupt_call:
            tensor = tensor.clone()
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


def _pair() -> tuple[LocalTransport, UpdateReceiver]:
    server_side, trainer_side = LocalTransport.group(2, timeout_s=5)
    return trainer_side, UpdateReceiver(server_side, source_rank=1)


def test_update_arrives_exactly_in_several_buckets() -> None:
    trainer, receiver = _pair()
    channel = DirectChannel(receiver)
    result = push_update([(channel, trainer)], _tensors(), version=3, mode="full", bucket_bytes=4096)
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
        push_update([(channel, corrupting)], _tensors(), version=4, mode="full", bucket_bytes=4096)
    assert channel.applied == []
    # the staging was dropped; the next clean update goes through
    push_update([(channel, trainer)], _tensors(), version=4, mode="full", bucket_bytes=4096)
    assert [u.version for u in channel.applied] == [4]


def test_sender_rejects_an_acknowledgement_with_another_checksum() -> None:
    trainer, receiver = _pair()
    with pytest.raises(SyncError, match="not trustworthy"):
        push_update(
            [(DirectChannel(receiver, tamper_reply=True), trainer)], _tensors(), version=1, mode="full"
        )


def test_every_receiver_gets_the_same_update() -> None:
    (trainer_a, receiver_a), (trainer_b, receiver_b) = _pair(), _pair()  # one private group per server
    channels = [DirectChannel(receiver_a), DirectChannel(receiver_b)]
    push_update(list(zip(channels, [trainer_a, trainer_b], strict=True)), _tensors(), version=2, mode="full")
    assert channels[0].applied[0].reply.checksum == channels[1].applied[0].reply.checksum


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
        push_update([(DirectChannel(receiver), trainer)], [], version=1, mode="full")


def test_content_digest_sees_flips_moves_and_length_but_not_thread_count() -> None:
    data = torch.randint(
        0, 256, ((3 << 19) + 5,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    digest = content_digest(data)
    flipped = data.clone()
    flipped[123_456] ^= 0x10
    swapped = data.clone()
    chunk = 8 << 16  # bytes per positional chunk
    swapped[:chunk], swapped[chunk : 2 * chunk] = data[chunk : 2 * chunk].clone(), data[:chunk].clone()
    odd_tail = data.clone()
    odd_tail[-1] ^= 0x01
    assert len({digest, content_digest(flipped), content_digest(swapped), content_digest(odd_tail)}) == 4
    assert content_digest(data[:-1]) != digest
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert content_digest(data.clone()) == digest
    finally:
        torch.set_num_threads(threads)
