"""Images arriving at the rollout server: base64 / data URLs, local files only under an allowed root.

Owns: :class:`MediaPolicy` (the allowed local media root, like vLLM's
``--allowed-local-media-path``, and the pixel limit) and :func:`decode_image`. Leaves out: the
trainer's encoding (``rollmatch.protocol.encode_image``) and what the processor does with pixels.

Safety rules, each a 4xx naming the image (never a 500, never a file probe):
- without ``--allowed-local-media-path`` the filesystem is never touched: a value that is not
  base64 gets the same answer whether or not such a file exists;
- with it, a value is a path only when it resolves (symlinks followed) to a file inside the root;
- the pixel count is read from the header and checked before any pixel is decoded (a 0.5 MB PNG
  can decode to gigabytes), and only common still-image formats are opened.
"""

from __future__ import annotations

import binascii
import io
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollmatch.protocol import from_base64
from rollmatch.server.limits import RequestTooLarge

if TYPE_CHECKING:
    from PIL.Image import Image

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "GIF", "TIFF")
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
_MAX_PATH_CHARS = 4096


@dataclass(frozen=True)
class MediaPolicy:
    """Where local images may come from (``None``: nowhere) and how many pixels an image may have."""

    allowed_root: Path | None = None
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS

    def __post_init__(self) -> None:
        if self.allowed_root is not None:
            root = Path(self.allowed_root).resolve()
            if not root.is_dir():
                raise ValueError(f"--allowed-local-media-path {self.allowed_root}: not a directory")
            object.__setattr__(self, "allowed_root", root)


def decode_image(value: str, policy: MediaPolicy = MediaPolicy(), where: str = "image") -> Image:
    """An RGB image from base64, a ``data:image/...;base64,`` URL, or a file under the allowed root.

    ``where`` names the image in errors (e.g. ``infer_requests[0].images[1]``). Raises
    ``ValueError`` (bad input) or :class:`~rollmatch.server.limits.RequestTooLarge` (too many pixels).
    """
    if value.startswith("data:"):
        raw = _b64(value.split(",", 1)[1] if "," in value else "", where)
    elif value.startswith(("http://", "https://")):
        raise ValueError(
            f"{where}: the rollout server does not fetch URLs ({value[:80]!r}); send base64 or a data URL"
        )
    else:
        local = _local_file(value, policy)
        raw = local.read_bytes() if local is not None else _b64(value, where, policy)
    return _open_checked(raw, policy.max_pixels, where)


def _local_file(value: str, policy: MediaPolicy) -> Path | None:
    """The file ``value`` names inside the allowed root, or ``None`` (then it must be base64)."""
    if policy.allowed_root is None or len(value) > _MAX_PATH_CHARS or "\x00" in value:
        return None
    text = value.removeprefix("file://")
    try:
        path = Path(text).resolve()
    except (OSError, RuntimeError):  # symlink loops, unreadable components
        return None
    if not path.is_relative_to(policy.allowed_root) or not path.is_file():
        return None
    return path


def _b64(value: str, where: str, policy: MediaPolicy | None = None) -> bytes:
    try:
        return from_base64(value)
    except (binascii.Error, ValueError) as exc:
        if policy is not None and policy.allowed_root is None:
            hint = (
                "local paths are refused: this server was started without --allowed-local-media-path "
                "(send base64 or a data URL)"
            )
        elif policy is not None:
            hint = f"nor a file under the allowed media path {policy.allowed_root}"
        else:
            hint = "the data URL's payload is not base64"
        raise ValueError(f"{where}: {value[:60]!r}... is not valid base64 ({exc}); {hint}") from exc


def _open_checked(raw: bytes, max_pixels: int, where: str) -> Image:
    from PIL import Image as PILImage

    try:
        with PILImage.open(io.BytesIO(raw), formats=IMAGE_FORMATS) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise RequestTooLarge(
                    where,
                    f"{where}: {width}x{height} = {width * height} pixels is over this server's limit of "
                    f"{max_pixels} (rollmatch serve --max-image-pixels); resize the image",
                )
            rgb = image.convert("RGB")
    except RequestTooLarge:
        raise
    except PILImage.DecompressionBombError as exc:
        raise RequestTooLarge(where, f"{where}: decompression bomb refused ({exc})") from exc
    except (
        OSError,
        SyntaxError,
        EOFError,
        ValueError,
        struct.error,
        IndexError,
        ZeroDivisionError,
        TypeError,
    ) as exc:  # PIL reports malformed files with any of these, depending on the codec
        raise ValueError(f"{where}: not a decodable {'/'.join(IMAGE_FORMATS)} image ({exc})") from exc
    if min(rgb.size) == 0:
        raise ValueError(f"{where}: an image of {rgb.size[0]}x{rgb.size[1]} pixels is empty")
    return rgb
