"""``GET /info/``, ``/health/``, ``/stats/``: what the trainer cross-checks at start-up, and serving facts."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

PROTOCOL_VERSION = 3  # 2: keyed weight digests (the key comes with the sync lease); 3: keyed BLAKE3


class ImageProbe(BaseModel):
    """How the server's processor resizes a fixed probe image (``data.prompts.image_probe``)."""

    size: tuple[int, int]  # (W, H) of the probe
    resized: tuple[int, int]  # (W, H) after the resize: the `pixels` frame of such an image
    image_tokens: int


class ServerInfo(BaseModel):
    """``GET /info/``: what the trainer cross-checks at start-up, plus serving facts."""

    protocol_version: int = PROTOCOL_VERSION
    engine: str
    model_dir: str
    fingerprint: dict[str, str]
    dtype: str
    max_model_len: int
    world_size: int
    weight_version: int
    sync_modes: list[str]
    # the `custom.object_format`s this server's tokenizer can decode (coord_tokens needs its tokens)
    object_formats: list[str] = Field(default_factory=lambda: ["qwen_json"])
    # The frame and resize the server serves (None: a server from before these fields; not compared).
    coord_frame: str | None = None  # `rollmatch serve --coord-frame`, resolved (norm1000 / pixels)
    min_pixels: int | None = None  # the processor's resize bounds (`--min-pixels` / `--max-pixels`)
    max_pixels: int | None = None
    image_probe: ImageProbe | None = None


class ServerHealth(BaseModel):
    """``GET /health/`` (200 when ``status`` is ``ok``, else 503): engine state and queue depth.

    ``engine`` is ``idle``, ``generating``, ``updating`` (a weight load or cache reset pending or
    running), ``stalled``, ``broken`` (a load failed half-way) or ``stopped``; ``operation`` the
    engine operation under way, if any."""

    status: Literal["ok", "stalled", "broken"]
    engine: str
    operation: str | None = None
    weight_version: int
    queued_calls: int
    running_calls: int
    outstanding_prompts: int
    pending_operations: int
    detail: str | None = None


class ServerStats(BaseModel):
    """``GET /stats/``: counters for monitoring and tests."""

    weight_version: int
    pushes_by_version: dict[int, int]
    failed_pushes: int  # rejected at finish, or abandoned (abandoned_pushes counts those)
    abandoned_pushes: int = 0  # staged buckets never finished: freed after the group timeout
    infer_requests: int
    infer_calls: int
    rejected_requests: int = 0  # 4xx answers of /infer/
    busy_refusals: int = 0  # calls refused with 429 (queue full) or 503 (engine stalled)
    rerun_calls: int = 0  # calls aborted by a weight update and run again under the new weights
    update_mode: str = "drain"
    communicator: str
