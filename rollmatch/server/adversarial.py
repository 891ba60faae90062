"""Adversarial request bodies for the rollout server: each one cost seconds of a whole server or
hundreds of MB before the boundary checks that now refuse it cheaply.

Owns: :func:`adversarial_bodies` (name -> ``(path, body bytes, needs_lease)``), shared by the fuzz
suite (``tests/server/test_fuzz.py``: each within a time bound, never a 5xx) and the hammer benchmark
(``bench/server_hammer.py``). Leaves out: how they are sent and what the answers must be.

Sizes are parameters so a test can use the small versions; the defaults are the sizes measured in
docs/server.md ("Request boundary").
"""

from __future__ import annotations

import io
import json

from rollmatch.protocol import to_base64


def redos_escapes(escapes: int = 16_000) -> bytes:
    """An unterminated string of ``\\"`` escapes: the former JSON value count rescanned it from every
    quote (quadratic, holding the GIL: 16,000 escapes took 5.7 s)."""
    return b'"' + b'\\"' * escapes


def redos_escapes_then_brackets(escapes: int = 300, brackets: int = 1 << 20) -> bytes:
    """A few escapes then a megabyte of ``[``: over the value cap's quick bound, so the count ran
    (8.1 s for the default sizes)."""
    return b'"' + b'\\"' * escapes + b"[" * brackets


def many_tiny_requests(size_bytes: int = 8 << 20) -> bytes:
    """``size_bytes`` of tiny requests (163k in 8 MB): the parser built them all before the request
    count was checked (2.2 s, +273 MB)."""
    one = b'{"prompt_token_ids":[1]},'
    count = max(1, size_bytes // len(one))
    return b'{"infer_requests":[' + (one * count)[:-1] + b"]}"


def many_prompt_ids(size_bytes: int = 8 << 20) -> bytes:
    """``size_bytes`` of prompt ids in one request: numbers escaped the value cap (+84 MiB)."""
    count = max(1, size_bytes // 6)
    return b'{"infer_requests":[{"prompt_token_ids":[' + b",".join([b"12345"] * count) + b"]}]}"


def invalid_prompt_ids(count: int = 1_048_000) -> bytes:
    """``count`` prompt ids of ``-1`` (3.1 MB at the default): within every cap, but one validation
    error per id, each rendered (10 s of CPU, +1.5 GB, a 4.7 s stall of the event loop)."""
    return b'{"infer_requests":[{"prompt_token_ids":[' + b",".join([b"-1"] * count) + b"]}]}"


def unknown_keys(count: int = 300_000) -> bytes:
    """One request with ``count`` unknown keys: one error per key (2 s, +307 MB)."""
    keys = b",".join(b'"k%d":0' % i for i in range(count))
    return b'{"infer_requests":[{"prompt_token_ids":[1],' + keys + b"}]}"


def non_string_images(count: int = 1_000_000) -> bytes:
    """``count`` numbers where image strings go: one error per item before the list's length bound."""
    return b'{"infer_requests":[{"prompt_token_ids":[1],"images":[' + b",".join([b"0"] * count) + b"]}]}"


def _image_body(image: bytes) -> bytes:
    request = {"messages": [{"role": "user", "content": "<image>find"}], "images": [to_base64(image)]}
    return json.dumps({"infer_requests": [request], "request_config": {"max_tokens": 2}}).encode()


def _jpeg(side: int, progressive: bool = False) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (200, 30, 30)).save(buffer, format="JPEG", progressive=progressive)
    return buffer.getvalue()


def tiff_strip_table(entries: int = 3_000_000, side: int = 2048) -> bytes:
    """A ``side`` x ``side`` TIFF whose strip tables claim ``entries`` strips, all pointing at one
    byte: within every pixel and size check, yet read whole at the header (a 3M-entry table, 12 MB,
    cost +992 MB)."""
    tags = [  # (tag, type, count, value or offset); type 3 = SHORT, 4 = LONG
        (256, 4, 1, side),
        (257, 4, 1, side),
        (258, 3, 1, 8),
        (259, 3, 1, 1),
        (262, 3, 1, 1),
        (273, 4, entries, 0),  # StripOffsets: the table's offset is patched in below
        (278, 4, 1, 1),
        (279, 4, entries, 0),  # StripByteCounts
    ]
    offsets_at = 8 + 2 + 12 * len(tags) + 4
    counts_at = offsets_at + 4 * entries
    data_at = counts_at + 4 * entries
    out = bytearray(b"II*\x00" + (8).to_bytes(4, "little") + len(tags).to_bytes(2, "little"))
    for tag, kind, count, value in tags:
        value = {273: offsets_at, 279: counts_at}.get(tag, value)
        out += tag.to_bytes(2, "little") + kind.to_bytes(2, "little") + count.to_bytes(4, "little")
        out += value.to_bytes(4, "little")
    out += (0).to_bytes(4, "little")
    out += data_at.to_bytes(4, "little") * entries + (1).to_bytes(4, "little") * entries + b"\x80"
    return _image_body(bytes(out))


def jpeg_many_segments(segments: int = 1_000_000) -> bytes:
    """A JPEG with ``segments`` empty APP0 segments before its frame (4 MB: +148 MB at the header)."""
    jpeg = _jpeg(1024)  # enough pixels that 4 MB of segments pass the bytes-per-pixel rule
    return _image_body(jpeg[:2] + b"\xff\xe0\x00\x02" * segments + jpeg[2:])


def jpeg_many_scans(scans: int = 2_000) -> bytes:
    """A progressive JPEG whose last scan is repeated ``scans`` times (2,000 scans in 87 KB decoded
    for 1.75 s, holding the call's reservations)."""
    jpeg = _jpeg(512, progressive=True)
    last = jpeg.rindex(b"\xff\xda")
    return _image_body(jpeg[:last] + jpeg[last:-2] * scans + b"\xff\xd9")


def padded_png(padding_bytes: int = 48 << 20) -> bytes:
    """An ``/infer/`` body whose one image is a 1x1 PNG followed by ``padding_bytes`` of trailing
    bytes: one pixel of the pixel budget for megabytes of body."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buffer, format="PNG")
    image = to_base64(buffer.getvalue() + b"\0" * padding_bytes)
    body = {
        "infer_requests": [
            {"messages": [{"role": "user", "content": "<image>find"}], "images": [image]},
        ],
        "request_config": {"max_tokens": 2},
    }
    return json.dumps(body).encode()


def big_peft_config(size_bytes: int = 8 << 20) -> bytes:
    """An adapter bucket whose ``peft_config`` holds ``size_bytes`` of ``[]``: parsed on the event loop
    before the lease was checked (1.2 s and +200 MiB on the loop)."""
    count = max(1, size_bytes // 3)
    nested = b"[" + b",".join([b"[]"] * count) + b"]"
    return b'{"lora_int_id":1,"metadatas":[],"peft_config":{"r":' + nested + b"}}"


def adversarial_bodies(scale: float = 1.0) -> dict[str, tuple[str, bytes, bool]]:
    """Name -> ``(path, body, needs_lease)``; ``scale`` shrinks (or grows) the large bodies."""

    def size(n: int) -> int:
        return max(1024, int(n * scale))

    return {
        "redos_escapes": ("/infer/", redos_escapes(16_000), False),
        "redos_escapes_then_brackets": ("/infer/", redos_escapes_then_brackets(300, size(1 << 20)), False),
        "many_tiny_requests": ("/infer/", many_tiny_requests(size(8 << 20)), False),
        "many_prompt_ids": ("/infer/", many_prompt_ids(size(8 << 20)), False),
        "padded_png": ("/infer/", padded_png(size(48 << 20)), False),
        "tiff_strip_table": ("/infer/", tiff_strip_table(size(3_000_000)), False),
        "jpeg_many_segments": ("/infer/", jpeg_many_segments(size(1_000_000)), False),
        "jpeg_many_scans": ("/infer/", jpeg_many_scans(2_000), False),
        "invalid_prompt_ids": ("/infer/", invalid_prompt_ids(size(1_048_000)), False),
        "unknown_keys": ("/infer/", unknown_keys(size(300_000)), False),
        "non_string_images": ("/infer/", non_string_images(size(1_000_000)), False),
        "big_peft_config_no_lease": (
            "/update_adapter_flattened_param/",
            big_peft_config(size(8 << 20)),
            False,
        ),
        "big_peft_config_with_lease": (
            "/update_adapter_flattened_param/",
            big_peft_config(size(8 << 20)),
            True,
        ),
        "redos_in_sync_body": ("/finish_weight_update/", redos_escapes(16_000), True),
    }
