"""Hypothesis strategies for rollout-server request bodies (shared by the in-process and real-server fuzz).

Bodies are JSON *text* (NaN / Infinity literals included, as Python's json writes them): valid
bodies with one or more fields replaced by hostile values, plus arbitrary JSON. Images are tiny
real PNGs, garbage, hostile local paths, or a cheap header-level bomb, so accepted bodies stay
fast to generate.
``chat_template_kwargs`` mixes the allowed flags with client templates (looping ones included) and
keys that change what runs; message texts include the probes of test_template_safety's template.
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

from hypothesis import strategies as st
from PIL import Image

from rollmatch.server import adversarial


def _png(size: tuple[int, int], mode: str = "RGB") -> str:
    buffer = io.BytesIO()
    Image.new(mode, size).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def _image_of(body: bytes) -> str:
    return str(json.loads(body)["infer_requests"][0]["images"][0])


SMALL_PNG = _png((28, 28))
TIFF_BOMB = _image_of(adversarial.tiff_strip_table(2_000, side=64))  # small container bombs: cheap to send
JPEG_SEGMENTS = _image_of(adversarial.jpeg_many_segments(1_000))
WIDE_PNG = _png((60, 20))
BOMB_PNG = _png((6000, 6000), mode="1")  # 36 M pixels in a few KB
IMAGES = st.sampled_from(
    [
        SMALL_PNG,
        WIDE_PNG,
        BOMB_PNG,
        f"data:image/png;base64,{SMALL_PNG}",
        "",
        "not base64!",
        "AAAA",
        "http://127.0.0.1:1/x.png",
        "/etc/passwd",
        "file:///etc/hostname",
        "/" + "a" * 4000,  # longer than a path may be (ENAMETOOLONG where files are read)
        "/tmp/" + "b" * 300,  # one component over NAME_MAX
        "/dev/zero",
        "/proc/self/fd/0",
        base64.b64encode(b"GIF89a").decode(),
        TIFF_BOMB,
        JPEG_SEGMENTS,
    ]
)

# Cheap to draw (sampled values, few nested strategies): CI sends >= 2,000 bodies in well under a minute.
_HOSTILE = [
    None,
    True,
    False,
    0,
    -1,
    1,
    7,
    2**31,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63) - 1,
    10**30,
    -(10**30),
    0.5,
    -0.0,
    1e-300,
    1e300,
    5e-324,
    float("nan"),
    float("inf"),
    float("-inf"),
    "",
    "x",
    "<image>",
    "\u0000",
    "1",
    "NaN",
    "💥" * 3,
    [],
    [1, 2],
    [-1],
    [2**64],
    {},
    {"a": 1},
]
NASTY = st.one_of(
    st.sampled_from(_HOSTILE),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
)

# Texts on which test_template_safety's PROBE_TEMPLATE fails (its looping probe left out: a fuzz run
# on code without the render budget would hang instead of failing).
TEMPLATE_PROBES = [
    "probe:raise",
    "probe:undefined",
    "probe:type",
    "probe:divide",
    "probe:unsafe",
    "probe:recurse",
]
_CLIENT_TEMPLATES = [
    "{{ raise_exception('client template ran') }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ ''.__class__.__mro__ }}",
    "MARKER",
    "{% for",
]
_TEMPLATE_KEYS = [
    "enable_thinking",
    "add_vision_id",
    "preserve_thinking",
    "chat_template",
    "tokenize",
    "add_generation_prompt",
    "tools",
    "messages",
    "eos_token",
    "continue_final_message",
    "max_pixels",
    "bogus",
]
TEMPLATE_KWARGS = st.dictionaries(
    st.sampled_from(_TEMPLATE_KEYS),
    st.one_of(st.booleans(), st.none(), st.sampled_from(_CLIENT_TEMPLATES), NASTY),
    max_size=3,
)

CONFIG_KEYS = [
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "num_beams",
    "stop",
    "seed",
    "stream",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "n",
    "best_of",
    "presence_penalty",
    "frequency_penalty",
    "length_penalty",
    "return_details",
    "structured_outputs_regex",
    "bogus",
]
REQUEST_KEYS = [
    "messages",
    "images",
    "prompt_token_ids",
    "sample_id",
    "audios",
    "videos",
    "tools",
    "objects",
    "data_dict",
    "uuid",
    "chat_template_kwargs",
    "add_eos",
    "bogus",
]


# Each strategy is built once, at import: a strategy built inside a draw is validated again on every
# draw (most of a fuzz run's time went there). The composite steps (token_ids, messages, infer_request,
# request_config) stay, since hypothesis mutates along them: a seed draws the same bodies either way
# (300 + 300 derandomized bodies compared equal).
_KEEP = object()  # drawn in place of a value built inside the draw (``st.just`` of it, built once)
JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)

# Prompt ids around the tiny model's special tokens (vision start 1157, image pad 1160, ...).
_SPECIAL_IDS = st.sampled_from([1149, 1150, 1157, 1158, 1159, 1160, 1161, 1148, 1161, 1162, 1215, 1216])
TOKEN_IDS = st.lists(
    st.one_of(st.integers(min_value=0, max_value=1100), _SPECIAL_IDS), min_size=1, max_size=40
)

_CONTENT = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["<image>find", "<image><image>two", "find", *(f"<image>{p}" for p in TEMPLATE_PROBES)]),
    st.lists(
        st.one_of(
            st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}),
            st.fixed_dictionaries({"type": st.just("image"), "image": IMAGES}),
            st.fixed_dictionaries(
                {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": IMAGES})}
            ),
            st.fixed_dictionaries({"type": st.just("image")}),
            st.fixed_dictionaries({"type": st.sampled_from(["audio", "video", 3])}),
        ),
        max_size=2,
    ),
    NASTY,
)
_ROLE = st.one_of(st.sampled_from(["user", "system", "assistant", "tool", "robot"]), NASTY)
_MESSAGE = st.one_of(st.fixed_dictionaries({"role": _ROLE, "content": _CONTENT}), NASTY)
MESSAGES = st.one_of(st.lists(_MESSAGE, max_size=2), NASTY)


@st.composite
def token_ids(draw: Any) -> list[int]:
    """Prompt ids around the tiny model's special tokens (vision start 1157, image pad 1160, ...)."""
    return draw(TOKEN_IDS)


@st.composite
def messages(draw: Any) -> Any:
    return draw(MESSAGES)


_REQUEST_BASE = st.one_of(
    st.fixed_dictionaries({"messages": messages(), "images": st.lists(IMAGES, max_size=3)}),
    st.fixed_dictionaries({"prompt_token_ids": token_ids(), "images": st.lists(IMAGES, max_size=2)}),
)
_REQUEST_KEYS_DRAWN = st.lists(st.sampled_from(REQUEST_KEYS), max_size=2)
_CONFIG_KEYS_DRAWN = st.lists(st.sampled_from(CONFIG_KEYS), max_size=3)
_KEEP_OR_NASTY = st.one_of(st.just(_KEEP), st.just(_KEEP), NASTY)  # the built value 2 times in 3 ...
_KEEP_NONE_OR_NASTY = st.one_of(st.just(_KEEP), st.just(_KEEP), st.none(), NASTY)  # ... or None too


@st.composite
def infer_request(draw: Any) -> Any:
    request: dict[str, Any] = draw(_REQUEST_BASE)
    for key in draw(_REQUEST_KEYS_DRAWN):
        request[key] = draw(NASTY)
    if draw(st.integers(0, 3)) == 0:
        request["chat_template_kwargs"] = draw(TEMPLATE_KWARGS)
    chosen = draw(_KEEP_OR_NASTY)
    return request if chosen is _KEEP else chosen


@st.composite
def request_config(draw: Any) -> Any:
    config: dict[str, Any] = {
        "max_tokens": draw(st.integers(min_value=1, max_value=6)),
        "return_details": True,
    }
    sampling = draw(st.booleans())
    if sampling:
        config.update(temperature=draw(st.floats(0.01, 2.0)), seed=draw(st.integers(0, 2**63 - 1)))
    for key in draw(_CONFIG_KEYS_DRAWN):
        config[key] = draw(NASTY)
    chosen = draw(_KEEP_NONE_OR_NASTY)
    return config if chosen is _KEEP else chosen


_INFER_REQUESTS = st.lists(infer_request(), max_size=2)
_REQUEST_CONFIG = request_config()


@st.composite
def _infer_body(draw: Any) -> str:
    body: Any = {"infer_requests": draw(_INFER_REQUESTS), "request_config": draw(_REQUEST_CONFIG)}
    if draw(st.integers(0, 9)) == 0:
        body = draw(JSON_VALUES)
    return json.dumps(body)


_INFER_BODIES = _infer_body()


def infer_bodies() -> st.SearchStrategy[str]:
    """JSON text of a ``POST /infer/`` body (mostly near-valid, sometimes anything)."""
    return _INFER_BODIES


LEASE_HEADER = "X-Rollmatch-Sync-Lease"
# Header values as bytes on the wire (the server decodes them as latin-1): anything a client can send
# in one header line, non-ASCII (UTF-8 or not) included.
LEASE_VALUES = st.one_of(
    st.sampled_from(
        [b"0" * 32, b"f" * 32, b"\xe9", "é".encode(), "ü".encode() * 16, "\U0001f511".encode(), b"\xff" * 32]
    ),
    st.binary(min_size=1, max_size=40).map(
        lambda raw: bytes(b if 0x21 <= b <= 0x7E or b >= 0x80 else 0x41 + b % 26 for b in raw)
    ),
)
LEASE_BUCKET = {  # a well-formed bucket announce: only the lease decides its answer
    "metadatas": [
        {
            "name": "lm_head.weight",
            "shape": [4],
            "dtype": "float32",
            "start_idx": 0,
            "end_idx": 16,
            "numel": 4,
        }
    ],
    "transaction": {"version": 1, "mode": "full", "bucket_index": 0, "num_bytes": 16},
}
# ``(path, JSON text)``: a well-formed request to each endpoint that reads the lease (the lease decides).
LEASE_BODIES = [
    ("/update_flattened_params/", json.dumps(LEASE_BUCKET)),
    (
        "/update_adapter_flattened_param/",
        json.dumps({**LEASE_BUCKET, "lora_int_id": 2, "peft_config": {"r": 2}}),
    ),
    (
        "/finish_weight_update/",
        json.dumps({"version": 1, "mode": "full", "bucket_checksums": [], "checksum": ""}),
    ),
    ("/close_communicator/", ""),
]
# Every spelling of "all interfaces" (refused), a few real interfaces, and names that do not resolve.
GROUP_HOSTS = [
    "127.0.0.1",
    "localhost",
    "::1",
    "0.0.0.0",
    "::",
    "0",
    "0x0",
    "000.000.000.000",
    "::0",
    "::ffff:0.0.0.0",
    "no-such-host.invalid",
    "a" * 64,
    "",
    "10.255.255.1",
]


_META = st.fixed_dictionaries(
    {
        "name": st.text(max_size=8),
        "shape": st.lists(NASTY, max_size=3),
        "dtype": st.sampled_from(["float32", "torch.bfloat16", "bogus", ""]),
        "start_idx": NASTY,
        "end_idx": NASTY,
        "numel": NASTY,
    }
)
_TRANSACTION = st.fixed_dictionaries(
    {
        "version": NASTY,
        "mode": st.sampled_from(["full", "adapter", "x"]),
        "bucket_index": NASTY,
        "num_bytes": NASTY,
    }
)
_SYNC_CALLS = st.one_of(
    st.tuples(
        st.just("/init_communicator/"),
        st.fixed_dictionaries(
            {
                "host": st.sampled_from(GROUP_HOSTS),
                "port": st.one_of(st.integers(0, 70000), NASTY),
                "world_size": st.one_of(st.integers(0, 3), NASTY),
                "timeout_s": st.one_of(st.floats(0.1, 2.0), NASTY),
                "backend": st.sampled_from(["gloo", "nccl", "mpi"]),
            }
        ),
    ),
    st.tuples(
        st.just("/update_flattened_params/"),
        st.fixed_dictionaries(
            {"metadatas": st.lists(_META, max_size=2), "transaction": st.one_of(_TRANSACTION, NASTY)}
        ),
    ),
    st.tuples(
        st.just("/update_adapter_flattened_param/"),
        st.fixed_dictionaries(
            {
                "lora_int_id": NASTY,
                "peft_config": NASTY,
                "metadatas": st.lists(_META, max_size=1),
                "transaction": _TRANSACTION,
            }
        ),
    ),
    st.tuples(
        st.just("/finish_weight_update/"),
        st.fixed_dictionaries(
            {
                "version": NASTY,
                "mode": st.sampled_from(["full", "adapter"]),
                "bucket_checksums": st.lists(st.text(max_size=4), max_size=2),
                "checksum": NASTY,
            }
        ),
    ),
    st.tuples(st.sampled_from(["/close_communicator/", "/reset_prefix_cache/", "/get_engine_type/"]), NASTY),
    st.tuples(
        st.sampled_from(["/init_communicator/", "/finish_weight_update/", "/update_flattened_params/"]),
        JSON_VALUES,
    ),
)
_SYNC_HEADERS = st.one_of(
    st.sampled_from([{}, {LEASE_HEADER: ""}]), st.fixed_dictionaries({LEASE_HEADER: LEASE_VALUES})
)


@st.composite
def _sync_body(draw: Any) -> tuple[str, str, dict[str, str | bytes]]:
    path, body = draw(_SYNC_CALLS)
    headers: dict[str, str | bytes] = draw(_SYNC_HEADERS)
    return path, json.dumps(body), headers


_SYNC_BODIES = _sync_body()


def sync_bodies() -> st.SearchStrategy[tuple[str, str, dict[str, str | bytes]]]:
    """``(path, JSON text, headers)`` for the weight-sync endpoints."""
    return _SYNC_BODIES


def json_values() -> st.SearchStrategy[Any]:
    """Any JSON value (scalars, lists and objects nested a few levels)."""
    return JSON_VALUES
