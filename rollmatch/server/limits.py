"""The rollout server's size limits and the answers for requests over them.

Owns: :class:`ServerLimits` (every cap ``rollmatch serve`` enforces, its default and help written
once on the field), the ``serve`` flags generated from it (:func:`add_server_limit_flags`,
:func:`server_limits`), the count of a body's JSON values (:func:`json_value_bound`) and of its
requests (:func:`count_infer_requests`), and :class:`RequestTooLarge`, the error that becomes a 413
(payload too large) or 422 (a value over a cap) naming the field and the flag.
Leaves out: the absolute wire ranges (``rollmatch.protocol``; a cap may only lower them) and where
each cap is checked (the body size in ``server.gate``, JSON values in ``server.app`` before the
body is parsed, images in ``server.media``, the rest in ``server.rollout_server``).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from rollmatch.protocol import MAX_IMAGES_PER_REQUEST, MAX_INFER_REQUESTS

UpdateMode = Literal["drain", "abort", "keep"]  # what a weight update does to in-flight calls
UPDATE_MODES: tuple[str, ...] = get_args(UpdateMode)


def _cap(default: Any, help_text: str) -> Any:
    """A :class:`ServerLimits` field: its default and its ``rollmatch serve --help`` line, written once."""
    return field(default=default, metadata={"help": help_text})


class RequestTooLarge(ValueError):
    """A request over one of the server's caps; ``status`` is 413 (payload) or 422 (a value)."""

    def __init__(self, field: str, message: str, status: int = 413):
        super().__init__(message)
        self.field, self.status = field, status


@dataclass(frozen=True)
class ServerLimits:
    """Caps of one server, each a ``rollmatch serve`` flag (defaults suit detection rollouts).

    Each field's default and one-line help are written once, on the field; the ``serve`` flags are
    generated from them (``rollmatch.cli``). What each cap bounds, and why its default:

    - ``max_body_bytes`` (``--max-body-bytes``): a request body, base64 images included (413);
    - ``max_json_values`` (``--max-json-values``): values of one ``/infer/`` or weight-sync body,
      bounded before it is parsed (413, :func:`json_value_bound`): objects, arrays and strings (keys
      included), plus one per comma (every further list item or member: numbers such as
      ``prompt_token_ids`` count too).
      The parser builds every value before a list's length bound applies, so a body of tiny values
      costs 10-50x its size in memory (8 MiB of ``{}`` took 184-390 MiB and up to 3 s, 14 MiB of
      short strings 139-205 MiB, 8 MiB of prompt ids +84 MiB); the default, 2^20, leaves 4,096 for
      each of 256 requests (a detection request holds about 35 plus its prompt ids);
    - ``max_json_keys`` (``--max-json-keys``): object keys of one such body, bounded before it is
      parsed by its colons (413): every key is followed by one; colons inside strings (a data URL
      holds one) only raise the bound. A key costs several values' worth to build (300k unknown keys
      took 0.4-0.8 s holding the GIL); the default, 2^16, leaves 256 for each of 256 requests;
    - ``max_inflight_body_bytes`` (``--max-inflight-body-bytes``): the raw bytes of every ``/infer/``
      body being received, parsed or prepared at once, reserved from ``Content-Length`` (or chunk by
      chunk) before the body is read and given back once the call is prepared (429 with
      ``Retry-After`` beyond it; a body alone over it is a 413); the default is four full bodies;
    - ``max_sync_body_bytes`` (``--max-sync-body-bytes``): the body of one weight-sync call
      (``/init_communicator/``, ``/update_flattened_params/``, ``/update_adapter_flattened_param/``,
      ``/finish_weight_update/``), checked after the lease and before the body is read (413): those
      bodies carry tensor metadata only (the tensors travel over the group);
    - ``max_image_pixels`` (``--max-image-pixels``): width x height of one image, read from its
      header before decoding (413);
    - ``max_call_pixels`` (``--max-call-pixels``): the pixels of every image of one call together,
      read from their headers before any is decoded (413); the default is 8 images at the
      per-image cap, 384 MiB as RGB (128 prompts of a 1-megapixel image, 256 of a COCO-sized one);
    - ``max_inflight_pixels`` (``--max-inflight-pixels``): the decoded pixels of every call in
      flight together, held from the header check until the call ends (429 with ``Retry-After``
      while other calls hold them); the default is eight full calls, 3 GiB as RGB;
    - ``max_call_tensor_bytes`` / ``max_inflight_tensor_bytes`` (``--max-call-tensor-bytes``,
      ``--max-inflight-tensor-bytes``): what the image processor makes of a call's images (their
      ``smart_resize``d patches as float32, computed from the headers before any is decoded; 413 /
      429). Source pixels undercount it: a 1x1 image becomes 74 KiB at ``min_pixels`` 3,136, a
      448x448 one 4.6 MiB, a 1-megapixel photograph 24 MiB. The defaults, 4 GiB and 16 GiB (four
      full calls), take what ``--max-call-pixels`` takes: 128 prompts of a 1-megapixel image, 256
      of a COCO-sized one;
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

    max_body_bytes: int = _cap(64 << 20, "request body cap (413)")
    max_json_values: int = _cap(
        1 << 20,
        "JSON values (objects, arrays, strings, list items) of one /infer/ or weight-sync body, counted "
        "before parsing (413)",
    )
    max_json_keys: int = _cap(
        1 << 16,
        "object keys of one /infer/ or weight-sync body, bounded by its colons before parsing (413)",
    )
    max_inflight_body_bytes: int = _cap(
        256 << 20, "raw /infer/ body bytes held at once, until each call is prepared (429 beyond)"
    )
    max_sync_body_bytes: int = _cap(
        8 << 20, "body of one weight-sync call, checked after the lease before reading (413)"
    )
    max_image_pixels: int = _cap(4096 * 4096, "width*height cap per image (413)")
    max_call_pixels: int = _cap(
        8 * 4096 * 4096,
        "width*height of all images of one call, from their headers before any is decoded (413; "
        "8 images of 4096x4096, 384 MiB as RGB)",
    )
    max_inflight_pixels: int = _cap(
        64 * 4096 * 4096,
        "decoded pixels of all calls in flight together (429 while others hold them; 64 images of "
        "4096x4096, 3 GiB as RGB)",
    )
    max_call_tensor_bytes: int = _cap(
        4 << 30,
        "bytes of the image processor's output (resized patches, float32) for one call, from the headers "
        "before any image is decoded (413)",
    )
    max_inflight_tensor_bytes: int = _cap(
        16 << 30,
        "bytes of prepared image tensors of all calls in flight together (429 while others hold them)",
    )
    max_requests_per_call: int = _cap(256, "infer_requests per call (413)")
    max_images_per_request: int = _cap(8, "images per prompt (413)")
    max_tokens: int = _cap(4096, "new tokens per response (422 above)")
    engine_stall_timeout_s: float = _cap(120.0, "engine operation without progress: 503")
    max_queued_prompts: int = _cap(4096, "prompts queued or running (429 above)")
    max_queued_prompt_tokens: int = _cap(1 << 23, "their prompt tokens (429 above)")
    update_mode: UpdateMode = _cap("drain", "in-flight calls at a weight update")  # noqa: RUF009 (a field())
    drain_timeout_s: float = _cap(60.0, "drain mode: abort and re-run after this")
    max_reruns: int = _cap(2, "a call re-run this often is waited for by the next update")
    request_read_timeout_s: float = _cap(30.0, "a request must arrive within this")
    keep_alive_timeout_s: float = _cap(15.0, "idle kept-alive connections closed")
    max_connections: int = _cap(
        512, "open connections (the oldest with no request head in progress is closed; 16 more for /health/)"
    )

    def __post_init__(self) -> None:
        positive = (
            "max_body_bytes",
            "max_json_values",
            "max_json_keys",
            "max_inflight_body_bytes",
            "max_sync_body_bytes",
            "max_image_pixels",
            "max_call_pixels",
            "max_inflight_pixels",
            "max_call_tensor_bytes",
            "max_inflight_tensor_bytes",
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
        if self.update_mode not in UPDATE_MODES:
            raise ValueError(
                f"--update-mode must be one of {', '.join(UPDATE_MODES)}, got {self.update_mode!r}"
            )
        self._check_order("max_image_pixels", "max_call_pixels", "a single image at the per-image cap")
        self._check_order("max_body_bytes", "max_inflight_body_bytes", "a body at the body cap")
        self._check_order("max_call_pixels", "max_inflight_pixels", "a full call")
        self._check_order("max_call_tensor_bytes", "max_inflight_tensor_bytes", "a full call")
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
        """Refuse (413) a body that may hold more JSON values than ``max_json_values``, before the
        parser builds them, from :func:`json_value_bound` alone (C speed, a few ms for 64 MiB; no
        scan of the text holds the GIL or runs per value)."""
        keys = _count(raw, b":")
        if keys > self.max_json_keys:
            raise RequestTooLarge(
                "--max-json-keys",
                f"request body may hold {keys} object keys (counted from its colons), over this server's "
                f"limit of {self.max_json_keys} (rollmatch serve --max-json-keys); send fewer keys per object "
                "or fewer requests per call",
            )
        limit = self.max_json_values
        bound = json_value_bound(raw)
        if bound > limit:
            raise RequestTooLarge(
                "--max-json-values",
                f"request body may hold {bound} JSON values (objects, arrays, strings and list items, counted "
                f"from its braces, brackets, commas and quotes), over this server's limit of {limit} (rollmatch "
                "serve --max-json-values); send fewer requests per call",
            )

    def check_request_count(self, raw: bytes) -> None:
        """Refuse (413) an ``/infer/`` body whose ``infer_requests`` holds more than
        ``max_requests_per_call`` items, before the parser builds them (it validates every item before
        a list's length bound applies: 8 MB of 163k tiny requests took 2.2 s and +273 MB). Counting
        ``{`` (C speed) settles ordinary bodies; a larger one is scanned up to the cap's next item."""
        limit = self.max_requests_per_call
        if _count(raw, b"{") <= limit:
            return
        count = count_infer_requests(raw, stop_after=limit + 1)
        if count > limit:
            raise RequestTooLarge(
                "infer_requests",
                f"infer_requests holds more than {limit} requests, over this server's limit of {limit} per call "
                "(rollmatch serve --max-requests-per-call); split the call",
            )

    def _check_order(self, smaller: str, larger: str, what: str) -> None:
        if getattr(self, larger) < getattr(self, smaller):
            raise ValueError(
                f"--{larger.replace('_', '-')} {getattr(self, larger)} is below --{smaller.replace('_', '-')} "
                f"{getattr(self, smaller)}: {what} could never be served; raise it"
            )


def add_server_limit_flags(parser: argparse.ArgumentParser) -> None:
    """One ``rollmatch serve`` flag per :class:`ServerLimits` field (``--max-body-bytes`` for
    ``max_body_bytes``), its help and default taken from the field; a flag not given parses to
    ``None`` and :func:`server_limits` keeps the field's default."""
    group = parser.add_argument_group(
        "limits", "caps of this server (docs/server.md, server.limits.ServerLimits)"
    )
    for cap in fields(ServerLimits):
        choices = UPDATE_MODES if cap.name == "update_mode" else None
        kind = {"int": int, "float": float}.get(str(cap.type), str)
        group.add_argument(
            f"--{cap.name.replace('_', '-')}",
            type=kind,
            choices=choices,
            default=None,
            help=f"{cap.metadata['help']}; default {_shown(cap.name, cap.default)}",
        )


def server_limits(args: argparse.Namespace) -> ServerLimits:
    """The flags given (``None`` = not given) over :class:`ServerLimits`' defaults."""
    given = {
        cap.name: getattr(args, cap.name)
        for cap in fields(ServerLimits)
        if getattr(args, cap.name, None) is not None
    }
    return ServerLimits(**given)


def _shown(name: str, value: Any) -> str:
    """A default as a reader writes it: 64 MiB, 2^20, 16777216 (4096x4096), 120 s."""
    if name.endswith("_bytes") and isinstance(value, int) and value % (1 << 20) == 0:
        return f"{value >> 20} MiB"
    if name.endswith("_s"):
        return f"{value:g} s"
    if isinstance(value, int) and value >= 1 << 16 and value & (value - 1) == 0:
        return f"2^{value.bit_length() - 1}"
    return str(value)


def json_value_bound(raw: bytes) -> int:
    """An upper bound, at C speed, of the values a JSON parser builds from ``raw``: every object and
    array opens with a brace or bracket, every string takes two quotes, and every item or member
    after the first of its container follows a comma (numbers, ``true`` and ``null`` count there).
    Exact for a body whose strings hold none of ``{[,"``: base64 images, ids and plain prompts;
    braces, commas and escaped quotes inside text only raise it. No pattern scan: the former exact
    count (a regex over every string) was quadratic on unterminated ``\\"`` escapes (31 KiB: 5.7 s
    holding the GIL) and, made linear, still iterated once per value in Python (0.8 s per 8 MB
    flood, stalling ``/health/`` under concurrent floods). Counted in windows of
    :data:`COUNT_WINDOW_BYTES`, so no single call holds the GIL for long on a 64 MiB body."""
    return _count(raw, b"{") + _count(raw, b"[") + _count(raw, b",") + _count(raw, b'"') // 2


COUNT_WINDOW_BYTES = 1 << 20


def _count(raw: bytes, byte: bytes) -> int:
    """``raw.count(byte)``, a window at a time (each call a millisecond or so; threads switch between)."""
    return sum(
        raw.count(byte, start, start + COUNT_WINDOW_BYTES) for start in range(0, len(raw), COUNT_WINDOW_BYTES)
    )


# Tokens of a JSON text for counting the items of one array: a string, a run of openers, a run of closers.
_JSON_STRUCTURE = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)|[{\[]++|[}\]]++', re.DOTALL)
_REQUESTS_KEY = "infer_requests"


def count_infer_requests(raw: bytes, stop_after: int | None = None) -> int:
    """The objects directly inside the top-level ``infer_requests`` array of a JSON text (every
    occurrence of the key counted), counting at most ``stop_after``, in one linear pass. On text
    that is not JSON the count is some number, never an error: the parser judges the syntax."""
    depth, count, key, inside = 0, 0, "", False
    for match in _JSON_STRUCTURE.finditer(raw):
        token = match.group()
        first = token[:1]
        if first == b'"':
            if depth == 1:
                key = _string_text(token)
            continue
        if first in (b"}", b"]"):
            depth -= len(token)
            inside = inside and depth >= 2
            continue
        if depth == 1 and first == b"[" and key == _REQUESTS_KEY:
            inside = True
        if inside and depth < 3 <= depth + len(token) and token[2 - depth : 3 - depth] == b"{":
            count += 1
            if stop_after is not None and count >= stop_after:
                return count
        depth += len(token)
    return count


def _string_text(token: bytes) -> str:
    """A JSON string token's text (escapes decoded), or ``""`` when it does not decode."""
    try:
        text = json.loads(token)
    except ValueError:
        return ""
    return text if isinstance(text, str) else ""
