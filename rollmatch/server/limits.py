"""The rollout server's size limits and the answers for requests over them.

Owns: :class:`ServerLimits` (every cap ``rollmatch serve`` enforces, with its flag) and
:class:`RequestTooLarge`, the error that becomes a 413 (payload too large) or 422 (a value over a
cap) naming the field and the flag. Leaves out: the absolute wire ranges (``rollmatch.protocol``)
and where each cap is checked (the body size in ``server.gate``, images in ``server.media``, the
rest in ``server.rollout_server``).
"""

from __future__ import annotations

from dataclasses import dataclass


class RequestTooLarge(ValueError):
    """A request over one of the server's caps; ``status`` is 413 (payload) or 422 (a value)."""

    def __init__(self, field: str, message: str, status: int = 413):
        super().__init__(message)
        self.field, self.status = field, status


@dataclass(frozen=True)
class ServerLimits:
    """Caps of one server, each a ``rollmatch serve`` flag (defaults suit detection rollouts).

    - ``max_body_bytes`` (``--max-body-bytes``): a request body, base64 images included (413);
    - ``max_image_pixels`` (``--max-image-pixels``): width x height of one image, read from its
      header before decoding (413);
    - ``max_requests_per_call`` (``--max-requests-per-call``): ``infer_requests`` of one call (413);
    - ``max_images_per_request`` (``--max-images-per-request``): images of one prompt (413);
    - ``max_tokens`` (``--max-tokens``): new tokens of one response; ``max_tokens: null`` gets
      ``min(room, cap)``, a larger explicit value a 422;
    - ``engine_stall_timeout_s`` (``--engine-stall-timeout-s``): a generation that makes no
      progress (no decoding step) for this long makes ``/health/`` answer 503.
    """

    max_body_bytes: int = 64 << 20
    max_image_pixels: int = 4096 * 4096
    max_requests_per_call: int = 256
    max_images_per_request: int = 8
    max_tokens: int = 4096
    engine_stall_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_image_pixels", "max_requests_per_call", "max_images_per_request"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.max_tokens <= 0 or self.engine_stall_timeout_s <= 0:
            raise ValueError("--max-tokens and --engine-stall-timeout-s must be > 0")
