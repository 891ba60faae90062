"""The weight-sync endpoints' bodies: communicator init and its reply (the lease and the digest key),
bucket announcements (a transaction header per bucket), adapter updates and the finishing call with
its checksums; which of these calls change the server's sync state (never sent twice)."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from rollmatch.protocol.wire import WireModel

MAX_GROUP_TIMEOUT_S = 3600.0  # no init or transfer may hold the sync state longer
MAX_BUCKET_BYTES = 1 << 36  # 64 GiB: larger announcements are refused before any allocation
MAX_WEIGHT_VERSION = 2**62
_NAME_CHARS = 1024
# Calls that change the sync state: each posts a receive on the group or moves the lease, so one that
# may have reached the server is never sent again (a second copy would desynchronise the group).
SYNC_STATE_CHANGES = frozenset(
    {
        "/init_communicator/",
        "/update_flattened_params/",
        "/update_adapter_flattened_param/",
        "/finish_weight_update/",
    }
)


class InitCommunicatorBody(WireModel):
    """swift's ``InitCommunicatorRequest`` plus the group backend and the rendezvous timeout.

    ``host`` is the server interface the weight-sync group listens on (the address the trainer
    reaches the server at; loopback when both share a host), never all interfaces.
    """

    host: str = Field(min_length=1, max_length=255)
    port: int = Field(gt=0, lt=65536)
    world_size: int = Field(gt=1, le=1024)
    client_device_uuid: str | None = Field(None, max_length=256)
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: float = Field(240.0, gt=0.0, le=MAX_GROUP_TIMEOUT_S)
    # The key of the update checksums (64 hex digits); absent: the server makes one. A trainer that
    # pushes to several servers gives them all one key, so it digests each bucket once.
    digest_key: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")


class InitCommunicatorReply(BaseModel):
    """``/init_communicator/``'s answer: swift's ``message`` plus the sync lease (sent with every bucket,
    finish and close) and the digest key (hex) that keys the update's checksums (the request's, or a
    fresh one); both die with the group."""

    message: str
    lease: str
    digest_key: str


class FlattenedTensorMeta(WireModel):
    """swift's ``FlattenedTensorMetadata``; ``start_idx``/``end_idx`` are byte offsets in the bucket."""

    name: str = Field(min_length=1, max_length=_NAME_CHARS)
    shape: list[Annotated[int, Field(ge=0, le=MAX_BUCKET_BYTES)]] = Field(max_length=16, fail_fast=True)
    dtype: str = Field(max_length=64)
    start_idx: int = Field(ge=0, le=MAX_BUCKET_BYTES)
    end_idx: int = Field(ge=0, le=MAX_BUCKET_BYTES)
    numel: int = Field(ge=0, le=MAX_BUCKET_BYTES)

    @field_validator("dtype")
    @classmethod
    def _plain_dtype(cls, value: str) -> str:
        return value.removeprefix("torch.")

    @model_validator(mode="after")
    def _consistent(self) -> FlattenedTensorMeta:
        if math.prod(self.shape) != self.numel:
            raise ValueError(f"tensor {self.name!r}: numel {self.numel} but shape {self.shape}")
        if self.end_idx < self.start_idx:
            raise ValueError(f"tensor {self.name!r}: end_idx {self.end_idx} < start_idx {self.start_idx}")
        return self


class TransactionHeader(WireModel):
    """Which update a bucket belongs to (absent: a swift-style update, applied as it arrives)."""

    version: int = Field(ge=0, le=MAX_WEIGHT_VERSION)
    mode: Literal["full", "adapter"]
    bucket_index: int = Field(ge=0, le=1 << 20)
    num_bytes: int = Field(gt=0, le=MAX_BUCKET_BYTES)


class UpdateFlattenedParamsBody(WireModel):
    metadatas: list[FlattenedTensorMeta] = Field(max_length=1 << 20, fail_fast=True)
    transaction: TransactionHeader | None = None


class UpdateAdapterBody(WireModel):
    lora_int_id: int = Field(ge=1, le=2**31 - 1)
    peft_config: dict[str, Any]
    metadatas: list[FlattenedTensorMeta] = Field(max_length=1 << 20, fail_fast=True)
    transaction: TransactionHeader | None = None


class FinishUpdateBody(WireModel):
    """The sender's account of an update: what the receiver must have got, bucket by bucket."""

    version: int = Field(ge=0, le=MAX_WEIGHT_VERSION)
    mode: Literal["full", "adapter"]
    bucket_checksums: list[Annotated[str, Field(max_length=64)]] = Field(max_length=1 << 20, fail_fast=True)
    checksum: str = Field(max_length=64)


class FinishUpdateReply(BaseModel):
    """The receiver's account: what it got and the version it serves now (or kept, on failure)."""

    ok: bool
    version: int
    checksum: str
    bucket_checksums: list[str]
    num_bytes: int
    num_tensors: int
    error: str | None = None
