"""Images arriving at the rollout server: base64 / data URLs, local files only under an allowed root.

Owns: :class:`MediaPolicy` (the allowed local media root, like vLLM's
``--allowed-local-media-path``, the pixel limit of one image and the size limit of one local
file), :func:`image_size` (an image's size from its header, nothing decoded), :func:`decode_image`,
and what decoded images may cost: :class:`PixelBudget` (the pixels of one call, and of every call
in flight) with the :class:`PixelLease` each call holds until it ends. Leaves out: the trainer's
encoding (``rollmatch.protocol.encode_image``), which images a request uses (``server.prompt_preparer``)
and what the processor does with pixels.

Safety rules, each a 4xx naming the image (never a 500, never a file probe):
- without ``--allowed-local-media-path`` the filesystem is never touched: a value that is not
  base64 gets the same answer whether or not such a file exists;
- with it, a value is a path only when it resolves (symlinks followed) to a regular file inside
  the root. The file is opened once and the *opened* file is checked (its path read back from
  ``/proc/self/fd``, its type and size from ``fstat``), then read through that descriptor: a
  symlink swapped in after the check cannot lead outside the root. Every ``OSError`` (missing,
  unreadable, a name too long, a loop) gets the answer of a value that is not a path, so the
  answer never tells whether a path exists outside the root; a file over ``max_file_bytes`` is a
  413 (``--max-body-bytes``: a local file may be as large as a request body);
- only PNG, JPEG and WEBP are opened, after a bounded walk of their container
  (``server.image_containers``: segments, scans, chunks and metadata bytes); the pixel count is
  read from the header and checked before any pixel is decoded (a 0.5 MB PNG can decode to
  gigabytes);
- an image's encoded size must fit its pixel count: at most :data:`MAX_ENCODED_BYTES_PER_PIXEL`
  bytes per pixel plus :data:`ENCODED_SLACK_BYTES` (413 beyond). The largest honest still image is
  16-bit RGBA stored without compression, 8 bytes per pixel; twice that covers container overhead
  (PNG row filters and stored zlib blocks, TIFF strips, BMP row padding), and the slack covers
  metadata (EXIF, ICC profiles, thumbnails). A 1x1 PNG padded with 48 MiB of trailing bytes, which
  costs one pixel of the pixel budget, is refused;
- a call's images are all checked from their headers, summed and reserved from the
  :class:`PixelBudget` before any of them is decoded (``--max-call-pixels``: 413,
  ``--max-inflight-pixels``: 429 while other calls hold the pixels).
"""

from __future__ import annotations

import binascii
import io
import os
import stat
import struct
import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from rollmatch.errors import ServerBusy
from rollmatch.protocol import from_base64
from rollmatch.server.image_containers import IMAGE_FORMATS, check_container
from rollmatch.server.limits import RequestTooLarge

if TYPE_CHECKING:
    from PIL.Image import Image

DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
DEFAULT_MAX_FILE_BYTES = 64 << 20  # ServerLimits.max_body_bytes' default
MAX_ENCODED_BYTES_PER_PIXEL = 16
ENCODED_SLACK_BYTES = 256 << 10
_MAX_PATH_CHARS = 4096
# Opened without following a last-component symlink (the path opened is already resolved), without
# blocking on a FIFO and without becoming a controlling terminal.
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)


@dataclass(frozen=True)
class MediaPolicy:
    """Where local images may come from (``None``: nowhere), how many pixels an image may have and
    how many bytes a local file may have."""

    allowed_root: Path | None = None
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    # The root as given (absolute, normalised without touching the file system) and resolved: a client
    # path must name a file under one of them before anything on disk is looked at.
    lexical_roots: tuple[Path, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.allowed_root is not None:
            root = Path(self.allowed_root).resolve()
            if not root.is_dir():
                raise ValueError(f"--allowed-local-media-path {self.allowed_root}: not a directory")
            given = Path(os.path.abspath(self.allowed_root))
            object.__setattr__(self, "allowed_root", root)
            object.__setattr__(self, "lexical_roots", (root,) if given == root else (root, given))


def image_size(
    value: str,
    policy: MediaPolicy = MediaPolicy(),
    where: str = "image",
    encoded: dict[str, bytes] | None = None,
) -> tuple[int, int]:
    """``(width, height)`` of the image ``value`` holds or names, read from its header (no pixel is
    decoded), with the checks and errors of :func:`decode_image`. With ``encoded``, a base64 image's
    bytes are kept there under ``where`` for :func:`decode_image` (base64 is decoded once)."""
    with (
        _image_bytes(value, policy, where, encoded, keep=True) as stream,
        _header(stream, policy.max_pixels, where) as image,
    ):
        return image.size


def decode_image(
    value: str,
    policy: MediaPolicy = MediaPolicy(),
    where: str = "image",
    encoded: dict[str, bytes] | None = None,
) -> Image:
    """An RGB image from base64, a ``data:image/...;base64,`` URL, or a file under the allowed root.

    ``where`` names the image in errors (e.g. ``infer_requests[0].images[1]``); ``encoded`` holds the
    bytes :func:`image_size` kept (taken out as used). Raises ``ValueError`` (bad input) or
    :class:`~rollmatch.server.limits.RequestTooLarge` (too many pixels, bytes far beyond them, or a
    local file too large).
    """
    with (
        _image_bytes(value, policy, where, encoded, keep=False) as stream,
        _header(stream, policy.max_pixels, where) as image,
    ):
        return image.convert("RGB")


class PixelBudget:
    """The decoded pixels calls may hold: one call at most ``max_call_pixels`` (a 413 naming
    ``--max-call-pixels``), every call in flight together at most ``max_inflight_pixels`` (a 429
    naming ``--max-inflight-pixels`` while other calls hold them). Thread-safe."""

    def __init__(self, max_call_pixels: int, max_inflight_pixels: int):
        self.max_call_pixels, self.max_inflight_pixels = max_call_pixels, max_inflight_pixels
        self._lock = threading.Lock()
        self._held = 0

    @property
    def held(self) -> int:
        """Pixels reserved by calls in flight now."""
        return self._held

    def reserve_call(
        self,
        images: Iterable[tuple[str, str]],
        policy: MediaPolicy,
        encoded: dict[str, bytes] | None = None,
        sizes: list[tuple[int, int]] | None = None,
    ) -> PixelLease:
        """Check every ``(field name, value)`` image of one call from its header (nothing decoded;
        the first error wins), then reserve their pixels; stops at the first image over the cap.
        ``encoded`` keeps the base64 images' bytes for decoding (see :func:`image_size`); ``sizes``
        gets every image's ``(width, height)``."""
        total = 0
        for where, value in images:
            width, height = image_size(value, policy, where, encoded)
            if sizes is not None:
                sizes.append((width, height))
            total += width * height
            if total > self.max_call_pixels:
                raise self._over_call(total, f"; {where} alone is {width}x{height}", at_least=True)
        return self.reserve(total)

    def reserve(self, pixels: int) -> PixelLease:
        """A lease on ``pixels`` (413 over the call cap, 429 while the server holds too many)."""
        if pixels > self.max_call_pixels:
            raise self._over_call(pixels)
        self._take(pixels)
        return PixelLease(self, pixels)

    def _take(self, pixels: int) -> None:
        with self._lock:
            if pixels and self._held + pixels > self.max_inflight_pixels:
                raise ServerBusy(self._busy_message(pixels), retry_after_s=1.0)
            self._held += pixels

    def _busy_message(self, pixels: int) -> str:
        return (
            f"the server holds {self._held} decoded image pixels for calls in flight; this call's "
            f"{pixels} would pass its limit of {self.max_inflight_pixels} (rollmatch serve "
            "--max-inflight-pixels); retry later or add servers"
        )

    def _give(self, pixels: int) -> None:
        with self._lock:
            self._held -= pixels

    def _over_call(self, pixels: int, detail: str = "", at_least: bool = False) -> RequestTooLarge:
        return RequestTooLarge(
            "infer_requests",
            f"infer_requests: the images of this call hold {'at least ' if at_least else ''}{pixels} pixels "
            f"once decoded ({pixels * 3 / 2**20:.0f} MiB as RGB{detail}), over this server's limit of "
            f"{self.max_call_pixels} per call (rollmatch serve --max-call-pixels); send fewer or smaller "
            "images per call",
        )


class TensorBudget(PixelBudget):
    """The bytes of the image processor's output (the patches an engine gets: ``smart_resize``d
    pixels x float32, ``PromptPreparer.tensor_bytes``) calls may hold: one call at most
    ``--max-call-tensor-bytes`` (413), all calls in flight ``--max-inflight-tensor-bytes`` (429).
    Source pixels undercount it: a 1x1 image becomes 74 KiB of patches at ``min_pixels`` 3,136."""

    def _busy_message(self, pixels: int) -> str:
        return (
            f"the server holds {self._held} bytes of prepared image tensors for calls in flight; this "
            f"call's {pixels} would pass its limit of {self.max_inflight_pixels} (rollmatch serve "
            "--max-inflight-tensor-bytes); retry later or add servers"
        )

    def _over_call(self, pixels: int, detail: str = "", at_least: bool = False) -> RequestTooLarge:
        return RequestTooLarge(
            "infer_requests",
            f"infer_requests: the images of this call become {pixels} bytes of image tensors once processed "
            f"(the processor's resized patches, float32), over this server's limit of {self.max_call_pixels} "
            "per call (rollmatch serve --max-call-tensor-bytes); send fewer images per call",
        )


class PixelLease:
    """The pixels one call holds until :meth:`release` (idempotent): when the engine is done with
    the call, or when it is refused. A lease dropped without release (a call abandoned between its
    preparation and its submission) gives its pixels back when it is garbage-collected."""

    def __init__(self, budget: PixelBudget, pixels: int):
        self.budget = budget
        self._pixels = [pixels]  # shared with the finalizer, which must not hold the lease
        self._finalizer = weakref.finalize(self, _give_back, budget, self._pixels)
        self.linked: list[PixelLease] = []  # released with this one (the call's tensor bytes)

    @property
    def pixels(self) -> int:
        return self._pixels[0]

    def cover(self, pixels: int) -> None:
        """Hold at least ``pixels`` (what the call decoded: a local file replaced between its header
        check and its decoding may be larger); over either cap raises as :meth:`PixelBudget.reserve`."""
        extra = pixels - self._pixels[0]
        if extra <= 0:
            return
        if pixels > self.budget.max_call_pixels:
            raise self.budget._over_call(pixels)
        self.budget._take(extra)
        self._pixels[0] = pixels

    def release(self) -> None:
        self._finalizer()
        for lease in self.linked:
            lease.release()


def _give_back(budget: PixelBudget, pixels: list[int]) -> None:
    budget._give(pixels[0])
    pixels[0] = 0


# ------------------------------------------------------------------------------------------ bytes
@contextmanager
def _image_bytes(
    value: str, policy: MediaPolicy, where: str, encoded: dict[str, bytes] | None = None, keep: bool = False
) -> Iterator[BinaryIO]:
    """The encoded image: base64 or a data URL decoded (or taken from ``encoded``, where it is kept
    when ``keep``), or the opened local file (closed after)."""
    if encoded is not None and where in encoded:
        yield io.BytesIO(encoded[where] if keep else encoded.pop(where))
    elif value.startswith("data:"):
        data = _b64(value.split(",", 1)[1] if "," in value else "", where)
        if keep and encoded is not None:
            encoded[where] = data
        yield io.BytesIO(data)
    elif value.startswith(("http://", "https://")):
        raise ValueError(
            f"{where}: the rollout server does not fetch URLs ({value[:80]!r}); send base64 or a data URL"
        )
    else:
        fd = _open_local(value, policy, where)
        if fd is None:
            data = _b64(value, where, policy)
            if keep and encoded is not None:
                encoded[where] = data
            yield io.BytesIO(data)
            return
        with os.fdopen(fd, "rb") as file:
            yield file


def _open_local(value: str, policy: MediaPolicy, where: str) -> int | None:
    """A read-only descriptor of the regular file ``value`` names inside the allowed root, or
    ``None`` (then it must be base64) for anything else and on any ``OSError``; a file over
    ``max_file_bytes`` is a :class:`RequestTooLarge`.

    Nothing outside the root is opened, nor looked up: a path not named under the root (as given or
    resolved; ``..`` removed as text) is refused before any file-system call, then the path is
    resolved and checked again (a symlink inside the root may lead out). The resolved path is opened
    (last component not followed), then the opened file itself is checked, so a component swapped
    for a symlink in between is caught.
    """
    root = policy.allowed_root
    if root is None or len(value) > _MAX_PATH_CHARS or "\x00" in value:
        return None
    try:
        path = value.removeprefix("file://")
        named = os.path.abspath(path)  # text only: ".." removed, nothing looked up
        if not any(Path(named).is_relative_to(lexical) for lexical in policy.lexical_roots):
            return None  # not even named under the root: no file-system lookup for it
        resolved = os.path.realpath(path)
        if not Path(resolved).is_relative_to(root):
            return None
        fd = os.open(resolved, _OPEN_FLAGS)
    except (OSError, ValueError, RuntimeError):  # missing, unreadable, too long, loops: all alike
        return None
    try:
        info = os.fstat(fd)
        usable = stat.S_ISREG(info.st_mode) and Path(_opened_path(fd)).is_relative_to(root)
    except OSError:
        usable = False
    if usable and info.st_size <= policy.max_file_bytes:
        return fd  # O_NONBLOCK does not apply to regular files
    os.close(fd)
    if usable:
        raise RequestTooLarge(
            where,
            f"{where}: the file is {info.st_size} bytes, over this server's limit of {policy.max_file_bytes} "
            "bytes for one local image (rollmatch serve --max-body-bytes)",
        )
    return None


def _opened_path(fd: int) -> str:
    """Where the open file ``fd`` lies now (Linux: ``/proc/self/fd``; raises ``OSError`` elsewhere)."""
    path = os.readlink(f"/proc/self/fd/{fd}")
    if not path.startswith("/"):  # "pipe:[...]", "anon_inode:..."
        raise OSError(f"descriptor {fd} is not a file ({path})")
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


# ----------------------------------------------------------------------------------------- pixels
@contextmanager
def _header(stream: BinaryIO, max_pixels: int, where: str) -> Iterator[Image]:
    """The image opened lazily (header read, nothing decoded) once its pixel count is within
    ``max_pixels``; PIL's errors in the ``with`` body (decoding) are reported as bad input too."""
    from PIL import Image as PILImage

    encoded_bytes = stream.seek(0, io.SEEK_END)
    stream.seek(0)
    check_container(stream, where)  # the container's structure, bounded, before any parser reads it
    try:
        with PILImage.open(stream, formats=IMAGE_FORMATS) as image:
            width, height = image.size
            fits = encoded_bytes <= MAX_ENCODED_BYTES_PER_PIXEL * width * height + ENCODED_SLACK_BYTES
            if width * height <= max_pixels and min(width, height) > 0 and fits:
                yield image
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
        if isinstance(exc, RequestTooLarge):
            raise
        raise ValueError(f"{where}: not a decodable {'/'.join(IMAGE_FORMATS)} image ({exc})") from exc
    if width * height > max_pixels:
        raise RequestTooLarge(
            where,
            f"{where}: {width}x{height} = {width * height} pixels is over this server's limit of "
            f"{max_pixels} (rollmatch serve --max-image-pixels); resize the image",
        )
    if min(width, height) == 0:
        raise ValueError(f"{where}: an image of {width}x{height} pixels is empty")
    if not fits:
        raise RequestTooLarge(
            where,
            f"{where}: {encoded_bytes} encoded bytes for {width}x{height} pixels, over the {MAX_ENCODED_BYTES_PER_PIXEL} "
            f"bytes per pixel (+{ENCODED_SLACK_BYTES >> 10} KiB of metadata) any honest encoding needs; send the "
            "image without trailing data",
        )
