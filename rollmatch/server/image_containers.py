"""Image containers at the rollout server: which formats are opened, and a bounded walk of their
structure before PIL reads a header.

Owns: :data:`IMAGE_FORMATS` (PNG, JPEG and WEBP, which detection data sets hold, and uncompressed
BMP, which the trainer's ``resized_bmp`` image wire sends) and :func:`check_container`, which reads the container's own structure at C speed or in a
bounded Python loop and refuses (413, or a 400 for a format that is not taken) what would make
PIL or its codecs spend memory or CPU far beyond the image's pixels:
- a JPEG: at most :data:`MAX_JPEG_SEGMENTS` segments before its first scan (1M empty APP0
  segments cost PIL +148 MB at the header read), at most :data:`MAX_JPEG_SCANS` scans (a
  progressive JPEG of 2,000 scans, 87 KB, decoded for 1.75 s), at most :data:`MAX_METADATA_BYTES`
  in APPn and COM segments;
- a PNG: at most :data:`MAX_PNG_CHUNKS` chunks (PIL's decoder loops over them in Python) and
  :data:`MAX_METADATA_BYTES` outside the image data;
- a BMP: uncompressed (``BI_RGB`` or ``BI_BITFIELDS``) with a ``BITMAPINFOHEADER`` or later: a
  fixed header, so nothing to walk;
- a WEBP: a still image (no animation), at most :data:`MAX_WEBP_CHUNKS` chunks and
  :data:`MAX_METADATA_BYTES` of metadata.
TIFF (a 3M-entry strip table, 12 MB, cost +992 MB at the header read), GIF, RLE BMP and the rest are
refused before any parser sees them. Leaves out: pixel counts and decoding (``server.media``).
"""

from __future__ import annotations

import io
import struct
from typing import BinaryIO

from rollmatch.server.limits import RequestTooLarge

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "BMP")
MAX_METADATA_BYTES = 1 << 20  # EXIF (<= 64 KiB per segment), ICC profiles (a few hundred KiB), XMP
MAX_JPEG_SEGMENTS = 256  # a camera JPEG has 10-30 before its first scan
MAX_JPEG_SCANS = 64  # libjpeg's progressive scripts use about 10; an EXIF thumbnail adds its own
MAX_PNG_CHUNKS = 1 << 16  # 64 MiB of 1 KiB IDAT chunks; encoders write 8-64 KiB each
MAX_WEBP_CHUNKS = 64
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_IMAGE_CHUNKS = frozenset({b"IHDR", b"PLTE", b"tRNS", b"IDAT", b"IEND", b"acTL", b"fcTL", b"fdAT"})
_JPEG_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM, RST0-7: no length field


def image_format(head: bytes) -> str | None:
    """The container ``head`` (its first 12 bytes or more) starts, if it is one taken here."""
    if head.startswith(_PNG_SIGNATURE):
        return "PNG"
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    if head.startswith(b"BM"):
        return "BMP"
    return None


def check_container(stream: BinaryIO, where: str) -> str:
    """Walk the image container in ``stream`` (left at its start); its format, or a
    ``ValueError`` / :class:`RequestTooLarge` naming ``where``."""
    data = stream.getvalue() if isinstance(stream, io.BytesIO) else stream.read()
    stream.seek(0)
    kind = image_format(data[:12])
    if kind is None:
        raise ValueError(
            f"{where}: not a decodable {'/'.join(IMAGE_FORMATS)} image (other formats are not taken: convert it to PNG or JPEG)"
        )
    {"PNG": _walk_png, "JPEG": _walk_jpeg, "WEBP": _walk_webp, "BMP": _check_bmp}[kind](data, where)
    return kind


def _walk_jpeg(data: bytes, where: str) -> None:
    position, segments, metadata = 2, 0, 0
    while True:
        while position < len(data) and data[position] == 0xFF:  # fill bytes before a marker code
            position += 1
        if position >= len(data) or data[position - 1] != 0xFF:
            raise ValueError(f"{where}: a JPEG whose segments do not reach a scan")
        marker = data[position]
        position += 1
        if marker == 0xDA:  # start of scan: the entropy-coded data follows
            break
        if marker == 0xD9:
            raise ValueError(f"{where}: a JPEG that ends before its first scan")
        segments += 1
        if segments > MAX_JPEG_SEGMENTS:
            raise _too_much(where, f"more than {MAX_JPEG_SEGMENTS} JPEG segments before the first scan")
        if marker in _JPEG_STANDALONE:
            continue
        if position + 2 > len(data):
            raise ValueError(f"{where}: a truncated JPEG segment")
        (length,) = struct.unpack_from(">H", data, position)
        if length < 2:
            raise ValueError(f"{where}: a JPEG segment of length {length}")
        if 0xE0 <= marker <= 0xEF or marker == 0xFE:
            metadata += length
            if metadata > MAX_METADATA_BYTES:
                raise _too_much(where, f"more than {MAX_METADATA_BYTES} bytes of JPEG metadata (APPn, COM)")
        position += length
    scans = data.count(b"\xff\xda", position - 2)  # stuffing (FF 00) keeps FF DA out of scan data
    if scans > MAX_JPEG_SCANS:
        raise _too_much(where, f"{scans} JPEG scans, over {MAX_JPEG_SCANS}")


def _walk_png(data: bytes, where: str) -> None:
    position, chunks, metadata = len(_PNG_SIGNATURE), 0, 0
    while position + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, position)
        chunks += 1
        if chunks > MAX_PNG_CHUNKS:
            raise _too_much(where, f"more than {MAX_PNG_CHUNKS} PNG chunks")
        if kind not in _PNG_IMAGE_CHUNKS:
            metadata += length
            if metadata > MAX_METADATA_BYTES:
                raise _too_much(where, f"more than {MAX_METADATA_BYTES} bytes of PNG metadata chunks")
        position += 12 + length
        if kind == b"IEND":
            return


def _walk_webp(data: bytes, where: str) -> None:
    position, chunks, metadata = 12, 0, 0
    while position + 8 <= len(data):
        kind, length = struct.unpack_from("<4sI", data, position)
        chunks += 1
        if chunks > MAX_WEBP_CHUNKS:
            raise _too_much(where, f"more than {MAX_WEBP_CHUNKS} WEBP chunks")
        if kind in (b"ANIM", b"ANMF"):
            raise ValueError(f"{where}: an animated WEBP; send a still image")
        if kind in (b"ICCP", b"EXIF", b"XMP "):
            metadata += length
            if metadata > MAX_METADATA_BYTES:
                raise _too_much(where, f"more than {MAX_METADATA_BYTES} bytes of WEBP metadata")
        position += 8 + length + (length & 1)


def _check_bmp(data: bytes, where: str) -> None:
    if len(data) < 34:
        raise ValueError(f"{where}: a truncated BMP")
    header_bytes, compression = struct.unpack_from("<I", data, 14)[0], struct.unpack_from("<I", data, 30)[0]
    if header_bytes < 40 or compression not in (0, 3):
        raise ValueError(
            f"{where}: a BMP with a {header_bytes}-byte header and compression {compression}; only uncompressed "
            "BMP (BI_RGB, BI_BITFIELDS) is taken: send PNG or JPEG"
        )


def _too_much(where: str, what: str) -> RequestTooLarge:
    return RequestTooLarge(where, f"{where}: {what}, which no photograph needs; re-encode the image")
