"""A weight update as a transaction: metadata -> buckets -> finish(version, checksums) -> ack.

Owns both halves. The sender (:func:`push_update`) streams buckets to one or more receivers over
their :class:`~rollmatch.sync.transport.WeightTransport`, announcing each bucket's layout on a
:class:`ControlChannel` first, then asks each receiver to finish with the per-bucket checksums it
computed before sending. The receiver (:class:`UpdateReceiver`) stages incoming buckets, and at
finish verifies that it got exactly those bytes; only a verified update is handed to the engine,
so a failed update leaves the receiver serving its previous version. The sender verifies the
receiver's reported checksum and version in turn.
Leaves out: which tensors to send (``sync.weights``), HTTP (``rollout.weight_push`` / ``server.app``),
and which servers a failed push drops (``rollout.weight_push``, from the :class:`ServerPushFailed` it raises).

Checksums (``sync.digest``): per bucket, a keyed BLAKE3 tree over its layout and exactly the
transmitted bytes (padding included), keyed with the digest key that came with the sync lease; the update checksum is a keyed MAC over the version, the mode and the bucket checksums.
Without the key no changed, missing, extra or moved byte passes. The sender announces a bucket as
soon as its layout is known and broadcasts and digests each leaf as soon as packing has written it
(:class:`_BucketStream`), so the first bytes travel while the rest of the bucket is packed and its
digest runs on the core packing leaves free; the receiver digests each leaf in a background thread
as soon as it lands, overlapping the next leaf's transfer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rollmatch.errors import PushPhase, RollmatchError, ServerPushFailed, SyncError
from rollmatch.protocol import (
    FinishUpdateBody,
    FinishUpdateReply,
    FlattenedTensorMeta,
    TransactionHeader,
    UpdateAdapterBody,
    UpdateFlattenedParamsBody,
    WireModel,
)
from rollmatch.sync.digest import bucket_tag, combine_checksums, leaf_spans, leaf_tag_async
from rollmatch.sync.transport import PendingTransfer, WeightTransport
from rollmatch.sync.weights import Bucket, TensorMeta, flatten_buckets, unflatten_bucket


class ControlChannel(Protocol):
    """The request/reply side channel of one receiver (HTTP to a server, or a direct call)."""

    url: str

    def post(self, path: str, body: WireModel | None, phase: str) -> dict[str, Any]:
        """POST ``body`` to ``path``; raise :class:`~rollmatch.errors.BackendError` on failure."""
        ...


@dataclass(frozen=True)
class AdapterPayload:
    """What an adapter update sends besides tensors: the PEFT config and vLLM's LoRA int id."""

    peft_config: dict[str, Any]
    lora_int_id: int


@dataclass
class PushResult:
    """One finished update, as the sender saw it."""

    version: int
    num_bytes: int
    num_tensors: int
    checksum: str
    seconds: float
    replies: list[FinishUpdateReply] = field(default_factory=list)


def push_update(
    targets: Sequence[tuple[ControlChannel, WeightTransport]],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int,
    mode: str,
    digest_key: bytes,
    bucket_bytes: int = 64 << 20,
    adapter: AdapterPayload | None = None,
) -> PushResult:
    """Send one update to every target and return once all of them verified and acknowledged it.

    ``digest_key``: the key every target's group was initialised with (``sync.digest``).

    Raises :class:`~rollmatch.errors.ServerPushFailed` (a ``SyncError``) carrying the receiver's URL and
    the phase for whatever failed at one receiver (a rejection, a checksum disagreement, a call or a
    transfer that failed); receivers keep their previous version in that case.
    """
    start = time.perf_counter()
    stream = _BucketStream(targets, version, mode, digest_key, adapter)
    for bucket in flatten_buckets(named_tensors, bucket_bytes, stream.filled):
        stream.packed(bucket)
    checksums = stream.finish_sending()
    finish = FinishUpdateBody(
        version=version,
        mode=mode,
        bucket_checksums=checksums,
        checksum=combine_checksums(digest_key, version, mode, checksums),
    )
    replies = []
    for channel, _ in targets:
        with _at(channel, "finish"):
            replies.append(_finish(channel, finish))
    return PushResult(
        version, stream.num_bytes, stream.num_tensors, finish.checksum, time.perf_counter() - start, replies
    )


class _BucketStream:
    """Sends and digests an update's buckets leaf by leaf while they are packed.

    ``flatten_buckets`` calls :meth:`filled` once a bucket's layout is known (the bucket is announced
    to every target) and after each tensor it copies: every leaf whose bytes are all written is
    broadcast to every target and digested in the pool at once, so the first bytes travel (and the
    receivers digest them) while the rest of the bucket is still being packed, and the sender's
    digest runs on a core packing leaves free. :meth:`packed` sends and digests what is left and
    waits for the bucket before (two buckets in flight at most). A bucket on an accelerator is sent
    and digested once packed (a leaf is copied to host memory to be hashed)."""

    def __init__(
        self,
        targets: Sequence[tuple[ControlChannel, WeightTransport]],
        version: int,
        mode: str,
        key: bytes,
        adapter: AdapterPayload | None,
    ):
        self._targets, self._version, self._mode, self._key = targets, version, mode, key
        self._adapter = adapter
        self._bucket: Bucket | None = None  # the bucket being packed
        self._spans: list[tuple[int, int]] = []
        self._transfers: list[list[PendingTransfer]] = []  # per target, one per leaf posted
        self._leaves: list[Future[bytes]] = []
        self._in_flight: tuple[int, Bucket, list[list[PendingTransfer]]] | None = None
        self._digested: list[tuple[list[TensorMeta], int, list[Future[bytes]]]] = []
        self.num_bytes = self.num_tensors = 0

    def filled(self, bucket: Bucket, end: int) -> None:
        """Bytes ``[0, end)`` of ``bucket`` are final (``flatten_buckets``' ``on_filled``)."""
        if bucket is not self._bucket:
            self._announce(bucket)
        if bucket.flat.device.type == "cpu":
            self._send_through(end)

    def packed(self, bucket: Bucket) -> None:
        """``bucket`` is complete: send and digest the rest, then wait for the bucket before it."""
        if bucket is not self._bucket:
            self._announce(bucket)
        self._send_through(bucket.num_bytes)
        index = len(self._digested)
        self._digested.append((bucket.metas, bucket.num_bytes, self._leaves))
        if self._in_flight is not None:
            self._wait_sent(*self._in_flight)
        self._in_flight = (index, bucket, self._transfers)
        self._bucket = None
        self.num_bytes += bucket.num_bytes
        self.num_tensors += len(bucket.metas)

    def finish_sending(self) -> list[str]:
        """Wait for the last bucket; every bucket's checksum, in order."""
        if self._in_flight is None:
            raise SyncError(f"weight update of version {self._version} ({self._mode}) has no tensors to send")
        self._wait_sent(*self._in_flight)
        return [
            bucket_tag(self._key, metas, num_bytes, [leaf.result() for leaf in leaves])
            for metas, num_bytes, leaves in self._digested
        ]

    def _announce(self, bucket: Bucket) -> None:
        header = TransactionHeader(
            version=self._version,
            mode=self._mode,
            bucket_index=len(self._digested),
            num_bytes=bucket.num_bytes,
        )
        for channel, _ in self._targets:
            with _at(channel, "announce"):
                _announce_bucket(channel, bucket, header, self._adapter)
        self._bucket, self._spans, self._leaves = bucket, leaf_spans(bucket.num_bytes), []
        self._transfers = [[] for _ in self._targets]

    def _send_through(self, end: int) -> None:
        assert self._bucket is not None
        flat = self._bucket.flat
        while len(self._leaves) < len(self._spans) and self._spans[len(self._leaves)][1] <= end:
            a, b = self._spans[len(self._leaves)]
            for (channel, transport), posted in zip(self._targets, self._transfers, strict=True):
                with _at(channel, "transfer"):
                    posted.append(transport.broadcast_async(flat[a:b], src=transport.rank))
            self._leaves.append(leaf_tag_async(self._key, a, flat[a:b], packing=True))

    def _wait_sent(self, index: int, bucket: Bucket, transfers: list[list[PendingTransfer]]) -> None:
        del bucket  # held until here: its buffer must outlive the transfer
        for (channel, _), posted in zip(self._targets, transfers, strict=True):
            with _at(channel, "transfer"):
                for transfer in posted:
                    transfer.wait(f"bucket {index} of version {self._version} to {channel.url}")


@contextmanager
def _at(channel: ControlChannel, phase: PushPhase) -> Iterator[None]:
    """A failure of the block, a receiver's, raised as :class:`ServerPushFailed` naming it: the pusher's
    failover drops exactly that server. Errors that are not rollmatch's (a bug, a local fault) pass."""
    try:
        yield
    except ServerPushFailed:
        raise
    except RollmatchError as exc:
        raise ServerPushFailed(channel.url, phase, exc) from exc


def _announce_bucket(
    channel: ControlChannel, bucket: Bucket, header: TransactionHeader, adapter: AdapterPayload | None
) -> None:
    """Tell the receiver a bucket's layout; it posts the bucket's receives before answering."""
    metas = [wire_meta(meta) for meta in bucket.metas]
    phase = f"announce bucket {header.bucket_index} of version {header.version}"
    if adapter is None:
        channel.post(
            "/update_flattened_params/", UpdateFlattenedParamsBody(metadatas=metas, transaction=header), phase
        )
    else:
        body = UpdateAdapterBody(
            lora_int_id=adapter.lora_int_id,
            peft_config=adapter.peft_config,
            metadatas=metas,
            transaction=header,
        )
        channel.post("/update_adapter_flattened_param/", body, phase)


def _finish(channel: ControlChannel, body: FinishUpdateBody) -> FinishUpdateReply:
    reply = FinishUpdateReply.model_validate(
        channel.post("/finish_weight_update/", body, f"finish version {body.version}")
    )
    if not reply.ok:
        raise SyncError(f"rollout server {channel.url} rejected weight version {body.version}: {reply.error}")
    if reply.checksum != body.checksum or reply.version != body.version:
        raise SyncError(
            f"rollout server {channel.url} acknowledged version {reply.version} with checksum {reply.checksum}, "
            f"but the trainer sent version {body.version} with checksum {body.checksum}: the update is not "
            "trustworthy; restart the server or check the network between trainer and server"
        )
    return reply


def wire_meta(meta: TensorMeta) -> FlattenedTensorMeta:
    """A bucket entry in swift's metadata shape (byte offsets)."""
    return FlattenedTensorMeta(
        name=meta.name,
        shape=list(meta.shape),
        dtype=meta.dtype,
        start_idx=meta.offset,
        end_idx=meta.offset + meta.nbytes,
        numel=meta.numel,
    )


def bucket_meta(meta: FlattenedTensorMeta) -> TensorMeta:
    """Inverse of :func:`wire_meta`."""
    return TensorMeta(meta.name, meta.dtype, tuple(meta.shape), meta.start_idx, meta.numel)


# --------------------------------------------------------------------------------------- receiver
@dataclass
class _StagedBucket:
    metas: list[TensorMeta]
    flat: torch.Tensor
    checksum: Future[str]  # resolves once the bytes landed and were digested


@dataclass
class VerifiedUpdate:
    """A finished, verified update: the tensors to load and the reply to send once loaded."""

    version: int
    mode: str
    tensors: list[tuple[str, torch.Tensor]]
    adapter: AdapterPayload | None
    reply: FinishUpdateReply


class UpdateReceiver:
    """Stages the buckets of the update in progress and verifies them at finish (one sender).

    An update that never reaches its finish is *abandoned*: replaced by a new bucket 0, released by
    :meth:`release_idle` after the sender went quiet, or dropped by :meth:`close`. Each case frees
    the staged buckets and calls ``on_abandon(header, why)`` once, so the owner can log and count it.
    """

    def __init__(
        self,
        transport: WeightTransport,
        source_rank: int,
        *,
        digest_key: bytes,
        device: torch.device | str = "cpu",
        on_abandon: Callable[[TransactionHeader, str], None] | None = None,
    ):
        self.transport, self.source_rank, self.device = transport, source_rank, torch.device(device)
        self._digest_key = digest_key
        self._header: TransactionHeader | None = None
        self._buckets: list[_StagedBucket] = []
        self._adapter: AdapterPayload | None = None
        self._last_activity = time.monotonic()
        self._on_abandon = on_abandon
        # One worker: buckets land in order, and digesting one overlaps the next one's transfer.
        self._digester = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-digest")

    def receive_bucket(
        self,
        header: TransactionHeader,
        metas: Sequence[FlattenedTensorMeta],
        adapter: AdapterPayload | None = None,
    ) -> None:
        """Post the receive of one announced bucket (returns before the bytes arrive)."""
        self._last_activity = time.monotonic()
        if header.bucket_index == 0:  # a new update replaces whatever an aborted one left staged
            self._abandon(f"replaced by bucket 0 of version {header.version}")
            self._buckets, self._adapter = [], adapter
        elif self._header is None or (header.version, header.mode) != (
            self._header.version,
            self._header.mode,
        ):
            raise SyncError(
                f"bucket {header.bucket_index} of version {header.version} arrived without its bucket 0"
            )
        elif header.bucket_index != len(self._buckets):
            raise SyncError(f"bucket {header.bucket_index} arrived, expected bucket {len(self._buckets)}")
        self._header = header
        plan = [bucket_meta(m) for m in metas]
        for wire, meta in zip(metas, plan, strict=True):
            if wire.end_idx - wire.start_idx != meta.nbytes:
                raise SyncError(
                    f"bucket {header.bucket_index}: tensor {meta.name!r} spans bytes [{wire.start_idx}, "
                    f"{wire.end_idx}) but {meta.numel} x {meta.dtype} needs {meta.nbytes}"
                )
        if any(m.offset + m.nbytes > header.num_bytes for m in plan):
            raise SyncError(
                f"bucket {header.bucket_index}: metadata points past its {header.num_bytes} bytes"
            )
        try:
            flat = torch.empty(header.num_bytes, dtype=torch.uint8, device=self.device)
        except (RuntimeError, MemoryError) as exc:  # an allocation the receiver cannot make
            raise SyncError(
                f"bucket {header.bucket_index}: cannot stage {header.num_bytes} bytes ({exc})"
            ) from exc
        leaves = [
            (a, b, self.transport.broadcast_async(flat[a:b], self.source_rank))
            for a, b in leaf_spans(header.num_bytes)
        ]
        phase = f"receive bucket {header.bucket_index} of version {header.version}"
        self._buckets.append(
            _StagedBucket(
                plan,
                flat,
                self._digester.submit(_landed_checksum, self._digest_key, leaves, phase, plan, flat),
            )
        )

    def finish(self, body: FinishUpdateBody) -> VerifiedUpdate:
        """Wait for the staged bytes and verify them; raises :class:`SyncError` on any disagreement.

        The staging is cleared either way: a rejected update is gone, the previous weights stay.
        """
        buckets, header, adapter = self._buckets, self._header, self._adapter
        self._buckets, self._header, self._adapter = [], None, None
        if header is None or (header.version, header.mode) != (body.version, body.mode):
            got = "nothing" if header is None else f"version {header.version} ({header.mode})"
            raise SyncError(f"finish of version {body.version} ({body.mode}) but the staged update is {got}")
        received = [bucket.checksum.result() for bucket in buckets]  # each wait is bounded by the group
        reply = FinishUpdateReply(
            ok=True,
            version=body.version,
            checksum=combine_checksums(self._digest_key, body.version, body.mode, received),
            bucket_checksums=received,
            num_bytes=sum(int(b.flat.numel()) for b in buckets),
            num_tensors=sum(len(b.metas) for b in buckets),
        )
        _verify(body, reply, buckets)
        tensors = [pair for b in buckets for pair in unflatten_bucket(b.metas, b.flat)]
        return VerifiedUpdate(body.version, body.mode, tensors, adapter, reply)

    @property
    def staged(self) -> TransactionHeader | None:
        """The header of the update being staged (``None`` when nothing is staged)."""
        return self._header if self._buckets else None

    def release_idle(self, max_idle_s: float) -> bool:
        """Abandon the staged update when no bucket arrived for ``max_idle_s``; True if one was freed."""
        if not self._buckets or time.monotonic() - self._last_activity <= max_idle_s:
            return False
        self._abandon(f"no bucket or finish for {max_idle_s:.0f}s")
        return True

    def close(self) -> None:
        """Free any staged update and stop the digest worker without waiting (a digest stuck on a dead
        sender times out on its own)."""
        self._abandon("the communicator was closed")
        self._digester.shutdown(wait=False, cancel_futures=True)

    def _abandon(self, why: str) -> None:
        header = self.staged
        self._buckets, self._header, self._adapter = [], None, None
        if header is not None and self._on_abandon is not None:
            self._on_abandon(header, why)


def _landed_checksum(
    key: bytes,
    leaves: list[tuple[int, int, PendingTransfer]],
    phase: str,
    metas: list[TensorMeta],
    flat: torch.Tensor,
) -> str:
    """The bucket's checksum, each leaf hashed as soon as it landed (while later leaves transfer)."""
    tags = []
    for start, end, transfer in leaves:
        transfer.wait(phase)
        tags.append(leaf_tag_async(key, start, flat[start:end]))
    return bucket_tag(key, metas, int(flat.numel()), [tag.result() for tag in tags])


def _verify(body: FinishUpdateBody, reply: FinishUpdateReply, buckets: list[_StagedBucket]) -> None:
    if len(body.bucket_checksums) != len(reply.bucket_checksums):
        raise SyncError(
            f"version {body.version}: the trainer sent {len(body.bucket_checksums)} buckets, the server "
            f"received {len(reply.bucket_checksums)}"
        )
    for index, (sent, got) in enumerate(zip(body.bucket_checksums, reply.bucket_checksums, strict=True)):
        if sent != got:
            names = [m.name for m in buckets[index].metas]
            shown = ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
            raise SyncError(
                f"version {body.version}: checksum mismatch in bucket {index} ({shown}): trainer {sent} vs "
                f"server {got} (update checksum trainer {body.checksum} vs server {reply.checksum}); the "
                "update was discarded and the server keeps its previous weights"
            )
