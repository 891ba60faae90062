"""The start-up cross-check of a rollout server against the trainer, as data and pure comparisons.

Owns: :class:`LocalModelInfo` (the trainer's side: model fingerprint, max length, object format,
resolved coordinate frame, resize bounds, probe-image resize), :func:`local_model_info` (built from
the resolved run, the model and the trainer's one processor) and the comparisons with a server's
``/info/`` (:func:`server_mismatches`, :func:`frame_and_resize_mismatches`), each mismatch one line
``key: trainer X vs server Y (fix)``. Leaves out: asking the servers and raising
(:meth:`~rollmatch.rollout.client.ServerBackend.check_compatible`) and the sync-mode check, which
depends on the backend's settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollmatch.config.resolved import ResolvedRun
from rollmatch.data.prompts import PROBE_IMAGE_SIZE, image_probe
from rollmatch.models.wrappers import strip_parallel_wrappers
from rollmatch.protocol import PROTOCOL_VERSION, ImageProbe, ServerInfo, fingerprint_mismatches


@dataclass(frozen=True)
class LocalModelInfo:
    """What the trainer serves its rollouts from, compared with every server at start-up.

    ``coord_frame``, ``min_pixels``, ``max_pixels`` and ``image_probe``: None leaves that comparison out
    (:func:`local_model_info` always fills them)."""

    # protocol.model_fingerprint: architecture, config, tokenizer, template, processor
    fingerprint: dict[str, str]
    max_length: int  # training.global_max_length: the server's max_model_len must hold it
    object_format: str  # custom.object_format: the server's tokenizer must support it
    coord_frame: str | None = None  # the resolved data.coord_frame
    min_pixels: int | None = None
    max_pixels: int | None = None
    image_probe: ImageProbe | None = None  # how the trainer's processor resizes the probe image


def local_model_info(run: ResolvedRun, model: Any, processor: Any) -> LocalModelInfo:
    """The trainer's :class:`LocalModelInfo`. ``processor``: the trainer's (``data.prompts.load_processor``);
    ``model`` may be ``None`` (the model directory's config is read instead)."""
    from rollmatch.protocol import model_fingerprint

    config = strip_parallel_wrappers(model).config if model is not None else None
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(run.model_dir))
    size = processor.image_processor.size
    resized, tokens = image_probe(processor)
    return LocalModelInfo(
        fingerprint=model_fingerprint(config, processor),
        max_length=run.config.training.global_max_length,
        object_format=run.config.custom.object_format,
        coord_frame=run.frame,
        min_pixels=int(size["shortest_edge"]),
        max_pixels=int(size["longest_edge"]),
        image_probe=ImageProbe(size=PROBE_IMAGE_SIZE, resized=resized, image_tokens=tokens),
    )


def server_mismatches(local: LocalModelInfo, info: ServerInfo) -> list[str]:
    """Every way the server of ``info`` differs from the trainer: fingerprint (the family is its
    ``model_type``), protocol version, max length, object format, frame, resize bounds and probe image."""
    lines = fingerprint_mismatches(local.fingerprint, info.fingerprint)
    if info.protocol_version != PROTOCOL_VERSION:
        lines.append(f"protocol_version: trainer {PROTOCOL_VERSION} vs server {info.protocol_version}")
    if info.max_model_len < local.max_length:
        lines.append(
            f"max length: trainer training.global_max_length {local.max_length} vs server "
            f"max_model_len {info.max_model_len} (serve with --max-model-len >= it)"
        )
    if local.object_format not in info.object_formats:
        lines.append(
            f"object format: trainer custom.object_format {local.object_format}, the server's tokenizer "
            f"supports {info.object_formats} (serve a model with the coordinate tokens: "
            "`rollmatch add-coord-tokens`)"
        )
    lines.extend(frame_and_resize_mismatches(local, info))
    return lines


def frame_and_resize_mismatches(local: LocalModelInfo, info: ServerInfo) -> list[str]:
    """``key: trainer X vs server Y (fix)`` for the coordinate frame, the resize bounds and the probe
    image's resized size and image-token count; a value either side leaves out (None) is not compared
    (older servers report none of them)."""
    lines: list[str] = []
    frame = local.coord_frame
    # coord_tokens fix the frame themselves (norm1000); the server's digit frame does not apply
    digits = local.object_format != "coord_tokens"
    if digits and frame is not None and info.coord_frame is not None and frame != info.coord_frame:
        lines.append(
            f"coord frame: trainer data.coord_frame {frame} vs server {info.coord_frame} "
            f"(serve with --coord-frame {frame})"
        )
    for key in ("min_pixels", "max_pixels"):
        mine, theirs = getattr(local, key), getattr(info, key)
        if mine is not None and theirs is not None and int(mine) != int(theirs):
            flag = key.replace("_", "-")
            lines.append(f"{key}: trainer data.{key} {mine} vs server {theirs} (serve with --{flag} {mine})")
    probe = local.image_probe
    if probe is not None and info.image_probe is not None and probe != info.image_probe:
        theirs = info.image_probe
        lines.append(
            f"probe image {probe.size[0]}x{probe.size[1]}: trainer resizes to {probe.resized[0]}x{probe.resized[1]} "
            f"({probe.image_tokens} image tokens) vs server {theirs.resized[0]}x{theirs.resized[1]} "
            f"({theirs.image_tokens} image tokens) (serve the trainer's processor: same patch/merge size "
            "and min/max pixels)"
        )
    return lines
