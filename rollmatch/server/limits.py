"""The rollout server's size limits and the answers for requests over them.

Owns: :class:`ServerLimits` (every cap ``rollmatch serve`` enforces, with its flag, and the count
of a body's JSON values, :func:`count_json_values`) and :class:`RequestTooLarge`, the error that
becomes a 413 (payload too large) or 422 (a value over a cap) naming the field and the flag.
Leaves out: the absolute wire ranges (``rollmatch.protocol``; a cap may only lower them) and where
each cap is checked (the body size in ``server.gate``, JSON values in ``server.app`` before the
body is parsed, images in ``server.media``, the rest in ``server.rollout_server``).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from rollmatch.protocol import MAX_IMAGES_PER_REQUEST, MAX_INFER_REQUESTS


class RequestTooLarge(ValueError):
    """A request over one of the server's caps; ``status`` is 413 (payload) or 422 (a value)."""

    def __init__(self, field: str, message: str, status: int = 413):
        super().__init__(message)
        self.field, self.status = field, status


@dataclass(frozen=True)
class ServerLimits:
    """Caps of one server, each a ``rollmatch serve`` flag (defaults suit detection rollouts).

    - ``max_body_bytes`` (``--max-body-bytes``): a request body, base64 images included (413);
    - ``max_json_values`` (``--max-json-values``): objects, arrays and strings (keys included) of one
      ``/infer/`` body, counted before it is parsed (413): the parser builds every value before a
      list's length bound applies, so a body of tiny values costs 10-50x its size in memory (8 MiB
      of ``{}`` took 184-390 MiB and up to 3 s, 14 MiB of short strings 139-205 MiB); the default,
      2^20, is 256 for each of 4,096 requests (a detection request holds about 35);
    - ``max_image_pixels`` (``--max-image-pixels``): width x height of one image, read from its
      header before decoding (413);
    - ``max_call_pixels`` (``--max-call-pixels``): the pixels of every image of one call together,
      read from their headers before any is decoded (413); the default is 8 images at the
      per-image cap, 384 MiB as RGB (128 prompts of a 1-megapixel image, 256 of a COCO-sized one);
    - ``max_inflight_pixels`` (``--max-inflight-pixels``): the decoded pixels of every call in
      flight together, held from the header check until the call ends (429 with ``Retry-After``
      while other calls hold them); the default is eight full calls, 3 GiB as RGB;
    - ``max_requests_per_call`` (``--max-requests-per-call``): ``infer_requests`` of one call (413),
      at most ``rollmatch.protocol.MAX_INFER_REQUESTS`` (the wire refuses more while parsing);
    - ``max_images_per_request`` (``--max-images-per-request``): images of one prompt (413), at most
      ``rollmatch.protocol.MAX_IMAGES_PER_REQUEST``;
    - ``max_tokens`` (``--max-tokens``): new tokens of one response; ``max_tokens: null`` gets
      ``min(room, cap)``, a larger explicit value a 422;
    - ``engine_stall_timeout_s`` (``--engine-stall-timeout-s``): an engine operation (generation,
      admission, weight load, cache reset) that makes no progress for this long makes ``/health/``
      answer 503 naming it, and calls waiting for the engine fail with a 503;
    - ``max_queued_prompts`` / ``max_queued_prompt_tokens`` (``--max-queued-prompts``,
      ``--max-queued-prompt-tokens``): prompts (and their tokens) queued or running on the engine;
      a call over either is a 429 with ``Retry-After`` (the client waits and retries);
    - ``update_mode`` (``--update-mode``): ``drain`` | ``abort`` | ``keep``, what a weight update
      does to in-flight calls (``server.scheduler``); ``drain_timeout_s`` (``--drain-timeout-s``):
      how long ``drain`` lets them finish before aborting and re-running them; ``max_reruns``
      (``--max-reruns``): a call aborted this many times is not aborted again: the next update
      waits for it (no re-run livelock when calls outlast the push interval);
    - ``request_read_timeout_s`` (``--request-read-timeout-s``): a request's head and body must
      arrive within this time of its first byte (or of the connection), else the connection is
      closed; ``keep_alive_timeout_s`` (``--keep-alive-timeout-s``): an idle kept-alive connection
      is closed after this; ``max_connections`` (``--max-connections``): open connections and
      requests at once (503 beyond).
    """

    max_body_bytes: int = 64 << 20
    max_json_values: int = 1 << 20
    max_image_pixels: int = 4096 * 4096
    max_call_pixels: int = 8 * 4096 * 4096
    max_inflight_pixels: int = 64 * 4096 * 4096
    max_requests_per_call: int = 256
    max_images_per_request: int = 8
    max_tokens: int = 4096
    engine_stall_timeout_s: float = 120.0
    max_queued_prompts: int = 4096
    max_queued_prompt_tokens: int = 1 << 23
    update_mode: str = "drain"
    drain_timeout_s: float = 60.0
    max_reruns: int = 2
    request_read_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 15.0
    max_connections: int = 512

    def __post_init__(self) -> None:
        positive = (
            "max_body_bytes",
            "max_json_values",
            "max_image_pixels",
            "max_call_pixels",
            "max_inflight_pixels",
            "max_requests_per_call",
            "max_images_per_request",
            "max_tokens",
            "engine_stall_timeout_s",
            "max_queued_prompts",
            "max_queued_prompt_tokens",
            "drain_timeout_s",
            "request_read_timeout_s",
            "keep_alive_timeout_s",
            "max_connections",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.max_reruns < 0:
            raise ValueError(f"--max-reruns must be >= 0, got {self.max_reruns}")
        if self.update_mode not in ("drain", "abort", "keep"):
            raise ValueError(f"--update-mode must be drain, abort or keep, got {self.update_mode!r}")
        self._check_order("max_image_pixels", "max_call_pixels", "a single image at the per-image cap")
        self._check_order("max_call_pixels", "max_inflight_pixels", "a full call")
        for name, wire_max in (
            ("max_requests_per_call", MAX_INFER_REQUESTS),
            ("max_images_per_request", MAX_IMAGES_PER_REQUEST),
        ):
            if getattr(self, name) > wire_max:
                raise ValueError(
                    f"--{name.replace('_', '-')} {getattr(self, name)} is over the wire's bound of {wire_max} "
                    "(rollmatch.protocol refuses more while parsing); lower it"
                )
        if self.max_queued_prompts < self.max_requests_per_call:
            raise ValueError(
                f"--max-queued-prompts {self.max_queued_prompts} is below --max-requests-per-call "
                f"{self.max_requests_per_call}: a full call could never be admitted; raise it"
            )

    def check_json_values(self, raw: bytes) -> None:
        """Refuse (413) a body with more JSON objects, arrays and strings than ``max_json_values``,
        before the parser builds them. Counting braces, brackets and quotes (C speed) bounds the count
        from above and settles ordinary bodies; only a body over the cap by that bound is scanned,
        and the scan stops one past the cap (so it costs at most the cap's worth of matches)."""
        limit = self.max_json_values
        if raw.count(b"{") + raw.count(b"[") + raw.count(b'"') <= limit:
            return
        if count_json_values(raw, stop_after=limit + 1) > limit:
            raise RequestTooLarge(
                "--max-json-values",
                f"request body holds more than {limit} JSON objects, arrays and strings, this server's "
                "limit (rollmatch serve --max-json-values); send fewer requests per call",
            )

    def _check_order(self, smaller: str, larger: str, what: str) -> None:
        if getattr(self, larger) < getattr(self, smaller):
            raise ValueError(
                f"--{larger.replace('_', '-')} {getattr(self, larger)} is below --{smaller.replace('_', '-')} "
                f"{getattr(self, smaller)}: {what} could never be served; raise it"
            )


# One JSON value that allocates: a string literal (escapes included), or the start of an object or array.
_JSON_VALUE = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[{\[]', re.DOTALL)


def count_json_values(raw: bytes, stop_after: int | None = None) -> int:
    """Objects, arrays and strings (keys included) in a JSON text, counting at most ``stop_after``.
    Braces inside a string are text. On text that is not JSON the count is some number, never an
    error: the parser judges the syntax."""
    return sum(1 for _ in itertools.islice(_JSON_VALUE.finditer(raw), stop_after))
