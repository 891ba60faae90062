"""Images on the wire: strict base64 and the default image encoding (lossless PNG)."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

import pybase64

if TYPE_CHECKING:
    from PIL.Image import Image


def to_base64(data: bytes) -> str:
    """Standard padded base64 (RFC 4648) as text. pybase64's SIMD codec writes the same characters as
    the standard library's ``base64`` at a small fraction of its time (about 0.2 ms per 150 KB image
    there, a noticeable share of a rollout call)."""
    return pybase64.b64encode(data).decode("ascii")


def from_base64(text: str) -> bytes:
    """Strict base64 decoding: a character outside the alphabet, whitespace or bad padding raises
    ``binascii.Error`` (a ``ValueError``)."""
    return pybase64.b64decode(text, validate=True)


def encode_image(image: Image) -> str:
    """Base64 PNG: lossless, so the server's processor sees the trainer's exact pixels.

    Compression level 1: several times faster to write than the default, for ~10-20% more bytes.
    The server side (decoding with its media policy and pixel limit) is ``server.media``.
    """
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)
    return to_base64(buffer.getvalue())
