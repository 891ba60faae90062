"""How the trainer's images travel to rollout servers inside ``/infer/`` (base64 strings).

Owns: the :class:`ImageWire` protocol and its two encodings, picked once from
``custom.extra.rollout_matching.vllm.server.image_wire`` by :func:`build_image_wire`:

- :class:`OriginalPng` (``png``, the default): each original image as base64 PNG, what any
  ms-swift-style server reads. Lossless, but PNG compression of full-size photographs is the most
  expensive step of a rollout call on a small model (docs/performance.md).
- :class:`ResizedBmp` (``resized_bmp``, opt-in): the image the trainer's processor already made,
  i.e. the resized pixels its ``pixel_values`` hold, recovered exactly from them (no resize, no
  compression) and sent as an uncompressed BMP. Still a plain base64 image: the server decodes it
  with the same media checks as any other. Its processor resizes an image that already has the
  target size to itself, so it makes the trainer's ``pixel_values`` bit for bit; the start-up
  fingerprint check guarantees the same processor settings on both sides.

Leaves out: the server's decoding and media policy (``server.media``) and the HTTP calls
(``rollout.connection``).
"""

from __future__ import annotations

import io
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image

from rollmatch.config.schema import ROLLOUT_KEY
from rollmatch.errors import BackendError, ConfigError, ConfigProblem
from rollmatch.protocol import encode_image, to_base64
from rollmatch.rollout.types import RolloutRequest

IMAGE_WIRE_KEY = f"{ROLLOUT_KEY}.vllm.server.image_wire"
# Recovered pixels must land this close to integers (float32 round trips stay below 1e-3).
_MAX_PIXEL_DEVIATION = 0.05


class ImageWire(Protocol):
    """Turns the images of one rollout request into the strings of ``InferRequest.images``."""

    name: str

    def encode(self, request: RolloutRequest) -> list[str]: ...


class OriginalPng:
    """The original images as base64 PNG (``rollmatch.protocol.encode_image``)."""

    name = "png"

    def encode(self, request: RolloutRequest) -> list[str]:
        return [encode_image(image) for image in request.images]


class ResizedBmp:
    """The processor-resized pixels of each image, recovered from ``pixel_values``, as base64 BMP.

    ``pixel_values`` rows are patches laid out as the Qwen-VL image processors write them:
    ``(grid_h / merge, grid_w / merge, merge, merge, channel, temporal, patch, patch)`` per image,
    normalised as ``(pixel * rescale_factor - mean) / std``. The first temporal copy is un-normalised
    and un-patched back to an ``H x W x 3`` uint8 image.
    """

    name = "resized_bmp"

    def __init__(self, image_processor: Any):
        missing = [
            attr
            for attr in ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std")
            if getattr(image_processor, attr, None) is None
        ]
        if (
            missing
            or not getattr(image_processor, "do_normalize", True)
            or not getattr(image_processor, "do_rescale", True)
        ):
            raise ConfigError(
                [
                    ConfigProblem(
                        IMAGE_WIRE_KEY,
                        self.name,
                        f"needs a Qwen-VL image processor that rescales and normalises patches ({type(image_processor).__name__} "
                        f"lacks {missing or 'do_rescale/do_normalize'}); use `png`",
                    )
                ]
            )
        self.patch = int(image_processor.patch_size)
        self.merge = int(image_processor.merge_size)
        self.temporal = int(image_processor.temporal_patch_size)
        rescale = float(getattr(image_processor, "rescale_factor", 1 / 255))
        shape = (1, 1, 1, 1, 3, 1, 1)  # broadcast over (gh/m, gw/m, m, m, channel, p, p)
        self._scale = (np.asarray(image_processor.image_std, dtype=np.float32) / rescale).reshape(shape)
        self._shift = (np.asarray(image_processor.image_mean, dtype=np.float32) / rescale).reshape(shape)

    def encode(self, request: RolloutRequest) -> list[str]:
        return [_bmp_base64(image) for image in self.resized_images(request)]

    def resized_images(self, request: RolloutRequest) -> list[Image.Image]:
        """The processor-resized RGB images behind ``request.pixel_values``, in image order."""
        pixels, grids = request.pixel_values, request.image_grid_thw
        if pixels is None or grids is None:
            raise BackendError(
                f"sample {request.sample_id!r}: {IMAGE_WIRE_KEY}: resized_bmp sends the pixels the trainer's processor "
                "made, but this request carries no pixel_values / image_grid_thw (encode prompts with PromptEncoder), "
                "or set the key to `png`"
            )
        rows = [int(t) * int(h) * int(w) for t, h, w in grids.tolist()]
        width = 3 * self.temporal * self.patch * self.patch
        if len(rows) != len(request.images) or pixels.shape != (sum(rows), width):
            raise BackendError(
                f"sample {request.sample_id!r}: pixel_values of shape {tuple(pixels.shape)} do not hold "
                f"{len(request.images)} image(s) of grids {grids.tolist()} with {width} values per patch: "
                f"the processor that encoded it is not the one {IMAGE_WIRE_KEY}: resized_bmp was built from"
            )
        images, offset = [], 0
        for (_, grid_h, grid_w), count in zip(grids.tolist(), rows, strict=True):
            images.append(self._unpatch(request.sample_id, pixels[offset : offset + count], grid_h, grid_w))
            offset += count
        return images

    def _unpatch(self, sample_id: str, patches: torch.Tensor, grid_h: int, grid_w: int) -> Image.Image:
        # numpy, not torch: a few single-threaded passes over ~150k values. torch would spread each
        # small op over its OpenMP threads, which stall for milliseconds on a loaded machine.
        m, p = self.merge, self.patch
        array = patches.detach().to("cpu", torch.float32).numpy()
        first = array.reshape(grid_h // m, grid_w // m, m, m, 3, self.temporal, p, p)[:, :, :, :, :, 0]
        values = first * self._scale + self._shift
        rounded = np.rint(values)
        deviation = float(np.abs(values - rounded).max()) if values.size else 0.0
        if deviation > _MAX_PIXEL_DEVIATION:
            raise BackendError(
                f"sample {sample_id!r}: pixel_values are not this processor's normalised 8-bit pixels (off by "
                f"{deviation:.3f}); trainer and {IMAGE_WIRE_KEY}: resized_bmp use different image processors, "
                "or set the key to `png`"
            )
        # (gh/m, gw/m, m, m, 3, p, p) -> (gh/m, m, p, gw/m, m, p, 3) -> H x W x 3
        pixels = np.clip(rounded, 0, 255).astype(np.uint8).transpose(0, 2, 5, 1, 3, 6, 4)
        return Image.fromarray(np.ascontiguousarray(pixels).reshape(grid_h * p, grid_w * p, 3))


def build_image_wire(name: str, processor: Any | None) -> ImageWire:
    """The encoding ``name`` names; ``resized_bmp`` needs the trainer's processor."""
    if name == "png":
        return OriginalPng()
    if name == "resized_bmp":
        if processor is None:
            raise ConfigError(
                [ConfigProblem(IMAGE_WIRE_KEY, name, "needs the trainer's processor; use `png`")]
            )
        return ResizedBmp(getattr(processor, "image_processor", processor))
    raise ConfigError([ConfigProblem(IMAGE_WIRE_KEY, name, "use `png` or `resized_bmp`")])


def _bmp_base64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="BMP")
    return to_base64(buffer.getvalue())
