"""Wire models of the rollout server, shared by the server (``server.app``) and its client.

Owns: the JSON shapes of every endpoint (pydantic) with the range of every number (checked here,
at the wire, before anything reaches an engine), base64 and the default image encoding (PNG),
the ``/infer/`` reply adapter, the ``Server-Timing`` header of ``/infer/`` answers, and conversion
between :class:`~rollmatch.rollout.types.Decoding` and ms-swift's ``request_config``.
Leaves out: engines, HTTP plumbing, the server's configurable caps and media policy
(``server.limits``, ``server.media``), the trainer's choice of image encoding
(``rollout.image_wire``) and the transfer of tensors.

Compatibility with ms-swift 4.x's ``swift rollout``: ``POST /infer/`` accepts every field of
``RolloutInferRequest`` and ``RequestConfig`` (options the server cannot honour, e.g. ``n > 1`` or
``stream``, are a 422 naming the field, never ignored) and answers a JSON
list of ``RolloutOutput`` items whose ``response`` is a ``ChatCompletionResponse`` with
``prompt_token_ids`` and per-choice ``token_ids`` / ``finish_reason``. Additions: a request may
carry the trainer's ``prompt_token_ids`` (used verbatim, never re-tokenized), every item carries
``weight_version``, and weight updates are transactions ending in ``/finish_weight_update/``.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Literal

import pybase64
from pydantic import BaseModel, ConfigDict, Field, StrictBool, TypeAdapter, field_validator, model_validator

from rollmatch.rollout.types import Decoding

if TYPE_CHECKING:
    from PIL.Image import Image

PROTOCOL_VERSION = 1


# ------------------------------------------------------------------------------------------- infer
# Absolute wire bounds; the server adds its own configurable caps (``rollmatch serve --max-*``).
SEED_MAX = 2**63 - 1  # every engine seeds a torch.Generator with an int64 (request j uses seed + j)
TEMPERATURE_MIN, TEMPERATURE_MAX = 0.01, 100.0  # besides 0 (greedy): no overflow in logits / T
PENALTY_MIN, PENALTY_MAX = 0.01, 100.0
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
MAX_SAMPLE_ID_CHARS = 256
TOKEN_ID_MAX = 2**31 - 1
# Counts, refused while the body is parsed (before a request object is built); the server's
# `--max-requests-per-call` (default 256) and `--max-images-per-request` (8) may only lower them.
MAX_INFER_REQUESTS = 4096  # per call
MAX_MESSAGES_PER_REQUEST = 256  # detection rollouts send 1-3, multi-turn chats tens
MAX_CONTENT_PARTS = 256  # text / image parts of one message
MAX_IMAGES_PER_REQUEST = 256  # the `images` list of one request
MESSAGE_ROLES = ("system", "user", "assistant")
# The chat-template variables a request may set (ms-swift's ``chat_template_kwargs``): switches the
# Qwen-VL / Qwen3 templates read, and ms-swift passes. Any other key is a 422 naming it: a request
# never brings its own template (``chat_template``), never overrides what the server passes
# (``tokenize``, ``add_generation_prompt``, ``tools``, the special tokens) and never sets a knob
# the server would silently ignore (ms-swift's ``max_pixels``). A template that reads no such
# variable renders the same with or without it.
TEMPLATE_FLAGS: dict[str, str] = {
    "enable_thinking": "Qwen3 / Qwen3.5 templates: false renders an empty thinking block",
    "preserve_thinking": "thinking templates: keep earlier turns' reasoning (ms-swift sends it)",
    "add_vision_id": "Qwen-VL templates: label each image 'Picture N:'",
}
# Options of ms-swift's RequestConfig that only take their default here: the value the server
# implements, per field. Anything else is a 422 naming the field (never silently ignored).
_DEFAULT_ONLY_OPTIONS: dict[str, Any] = {
    "num_beams": 1,
    "n": 1,
    "best_of": (None, 1),
    "stream": False,
    "logprobs": False,
    "top_logprobs": None,
    "prompt_logprobs": None,
    "min_p": (None, 0.0),
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "length_penalty": 1.0,
    "structured_outputs_regex": None,
}


class WireModel(BaseModel):
    """Base of every wire model: unknown fields are errors (a typo never passes silently), and
    NaN / Infinity are refused wherever a number is expected."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class RequestConfig(WireModel):
    """ms-swift 4.x ``RequestConfig``, every field. ``None`` means the server default (greedy, all the
    room left up to the server's ``--max-tokens`` cap)."""

    max_tokens: int | None = Field(None, gt=0, le=TOKEN_ID_MAX)
    temperature: float | None = Field(None, ge=0.0, le=TEMPERATURE_MAX)
    top_k: int | None = Field(None, ge=-1, le=TOKEN_ID_MAX)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=PENALTY_MIN, le=PENALTY_MAX)
    num_beams: int = 1
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] | None = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS
    )
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    stream: bool = False
    logprobs: bool = False
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    length_penalty: float = 1.0
    return_details: bool = False
    structured_outputs_regex: str | None = None

    @field_validator("temperature")
    @classmethod
    def _temperature_greedy_or_sane(cls, value: float | None) -> float | None:
        if value is not None and 0.0 < value < TEMPERATURE_MIN:
            raise ValueError(
                f"temperature {value} is too small to sample with (logits / T overflow); send 0 for greedy "
                f"decoding or a value in [{TEMPERATURE_MIN}, {TEMPERATURE_MAX}]"
            )
        return value

    @model_validator(mode="after")
    def _only_implemented_options(self) -> RequestConfig:
        for key, allowed in _DEFAULT_ONLY_OPTIONS.items():
            accepted = allowed if isinstance(allowed, tuple) else (allowed,)
            if getattr(self, key) not in accepted:
                raise ValueError(
                    f"request_config.{key} = {getattr(self, key)!r} is not supported by the rollmatch rollout "
                    f"server; send {accepted[0]!r} (or omit it)"
                )
        return self


class TextPart(WireModel):
    type: Literal["text"]
    text: str


class ImageUrl(WireModel):
    url: str
    detail: str | None = None


class ImagePart(WireModel):
    """``{"type": "image", "image": ...}`` or ``{"type": "image_url", "image_url": {"url": ...}}``; a part
    without its value takes the next entry of the request's ``images``."""

    type: Literal["image", "image_url"]
    image: str | None = None
    image_url: ImageUrl | str | None = None

    @property
    def value(self) -> str | None:
        value = self.image if self.type == "image" else self.image_url
        return value.url if isinstance(value, ImageUrl) else value


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatTurn(WireModel):
    """One chat message: string content (with ``<image>`` tags) or a list of text / image parts."""

    role: str
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)]

    @field_validator("role")
    @classmethod
    def _known_role(cls, value: str) -> str:
        if value not in MESSAGE_ROLES:
            raise ValueError(
                f"unknown role {value[:40]!r}: a message role is one of {', '.join(MESSAGE_ROLES)}"
            )
        return value


class InferRequest(WireModel):
    """One prompt: chat ``messages`` + ``images`` (ms-swift 4.x ``RolloutInferRequest``, every field),
    and/or the trainer's ``prompt_token_ids``.

    With ``prompt_token_ids`` the ids are used as given and ``messages`` are ignored; the images
    must be the ones whose placeholders the ids contain.
    """

    messages: list[ChatTurn] = Field(default_factory=list, max_length=MAX_MESSAGES_PER_REQUEST)
    images: list[str] = Field(default_factory=list, max_length=MAX_IMAGES_PER_REQUEST)
    prompt_token_ids: list[Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]] | None = None
    sample_id: str | None = Field(None, max_length=MAX_SAMPLE_ID_CHARS)
    # swift fields with no meaning for detection rollouts: accepted when empty.
    audios: list[str] = Field(default_factory=list)
    videos: list[str] = Field(default_factory=list)
    tools: list[Any] | None = None
    objects: dict[str, Any] = Field(default_factory=dict)
    data_dict: dict[str, Any] = Field(default_factory=dict)
    uuid: str | None = Field(None, max_length=MAX_SAMPLE_ID_CHARS)
    chat_template_kwargs: dict[str, StrictBool | None] = Field(default_factory=dict)
    add_eos: bool | Literal["auto"] | None = None

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _only_template_flags(cls, value: Any) -> Any:
        """Only the keys of :data:`TEMPLATE_FLAGS` (each true, false or null: the template's default)."""
        if not isinstance(value, dict):
            return value  # pydantic names the type
        refused = [key for key in value if key not in TEMPLATE_FLAGS]
        if not refused:
            return value
        shown = ", ".join(repr(str(key)[:40]) for key in refused[:5]) + (" ..." if len(refused) > 5 else "")
        why = (
            "a request cannot bring its own chat template, the server renders the served model's own"
            if "chat_template" in refused
            else "the server sets these itself or does not take them"
        )
        raise ValueError(
            f"chat_template_kwargs may not set {shown} ({why}); the keys it may set are "
            f"{', '.join(TEMPLATE_FLAGS)}, each true, false or null"
        )

    @model_validator(mode="after")
    def _has_a_prompt(self) -> InferRequest:
        if not self.messages and not self.prompt_token_ids:
            raise ValueError("an infer request needs `messages` or `prompt_token_ids`")
        if self.audios or self.videos or self.tools:
            raise ValueError("audios, videos and tools are not supported by the rollmatch rollout server")
        if self.add_eos not in (None, False):
            raise ValueError(
                f"add_eos = {self.add_eos!r}: the rollout server generates responses, it does not score "
                "completed ones; send null (or omit it)"
            )
        return self


class InferBody(WireModel):
    """Body of ``POST /infer/``; ``metrics``/``template``/``use_tqdm``/``adapter_request`` are swift's."""

    infer_requests: list[InferRequest] = Field(max_length=MAX_INFER_REQUESTS)
    request_config: RequestConfig | None = None
    metrics: Any = None
    template: Any = None
    use_tqdm: bool | None = None
    adapter_request: None = None


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    tool_calls: None = None
    reasoning_content: None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None
    token_ids: list[int] | None = None  # stop-trimmed response ids (with return_details)
    routed_experts: None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionResponse(BaseModel):
    model: str
    choices: list[ChatChoice]
    usage: Usage
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: None = None
    images_size: list[tuple[int, int]] | None = None


class RolloutOutput(BaseModel):
    """One item of the ``/infer/`` reply: swift's ``RolloutOutput`` plus ``weight_version``."""

    response: ChatCompletionResponse
    messages: list[dict[str, Any]] | None = None
    response_token_ids: list[list[int]] = Field(default_factory=list)
    response_loss_mask: list[list[int]] = Field(default_factory=list)
    rollout_infos: dict[str, Any] = Field(default_factory=dict)
    rollout_logprobs: list[list[float]] = Field(default_factory=list)
    prompt_logprobs: None = None
    weight_version: int  # the oldest weight version that produced this output
    weight_version_last: int | None = None  # the newest; differs only under `serve --update-mode keep`
    sample_id: str | None = None


# The whole ``/infer/`` reply: serialised by the server and parsed by the client in one pass each
# (pydantic's JSON encoder / parser, no intermediate Python dicts).
INFER_REPLY = TypeAdapter(list[RolloutOutput])


def request_config_from_decoding(decoding: Decoding, seed: int | None) -> RequestConfig:
    """The ``request_config`` that asks a server for exactly ``decoding`` (token ids included)."""
    return RequestConfig(
        max_tokens=decoding.max_new_tokens,
        temperature=decoding.temperature,
        top_k=decoding.top_k,
        top_p=decoding.top_p,
        repetition_penalty=decoding.repetition_penalty,
        seed=seed,
        return_details=True,
    )


def decoding_from_request_config(
    config: RequestConfig, room: int, max_tokens_cap: int | None = None
) -> Decoding:
    """Server side: swift's ``None`` defaults become greedy decoding with ``room`` new tokens.

    ``room`` is what the longest prompt leaves within the server's ``max_model_len``;
    ``max_tokens_cap`` the server's ``--max-tokens`` (``None``: no cap).
    """
    if room <= 0:
        raise ValueError(
            f"prompt too long: the longest prompt leaves no room for new tokens ({-room + 1} token(s) over the "
            "server's max_model_len); shorten it or serve with a larger --max-model-len"
        )
    if config.max_tokens is not None and config.max_tokens > room:
        raise ValueError(
            f"request_config.max_tokens = {config.max_tokens} does not fit: the longest prompt leaves room for "
            f"{room} new tokens within the server's max_model_len; lower max_tokens or serve with a larger "
            "--max-model-len"
        )
    max_new = room if config.max_tokens is None else config.max_tokens
    if max_tokens_cap is not None:
        if config.max_tokens is not None and config.max_tokens > max_tokens_cap:
            raise ValueError(
                f"request_config.max_tokens = {config.max_tokens} is over this server's cap of {max_tokens_cap} "
                "new tokens per request (rollmatch serve --max-tokens)"
            )
        max_new = min(max_new, max_tokens_cap)
    return Decoding(
        temperature=0.0 if config.temperature is None else config.temperature,
        top_p=1.0 if config.top_p is None else config.top_p,
        top_k=-1 if config.top_k in (None, 0) else config.top_k,
        repetition_penalty=1.0 if config.repetition_penalty is None else config.repetition_penalty,
        max_new_tokens=max_new,
    )


# ------------------------------------------------------------------------------------------ images
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


# ------------------------------------------------------------------------------------- timings
# ``/infer/`` answers carry the server's own phase times in the standard ``Server-Timing`` header
# (``parse;dur=1.204, engine;dur=250.1``, milliseconds), so a client can tell transfer from work.
SERVER_TIMING_HEADER = "Server-Timing"


def format_server_timing(seconds: dict[str, float]) -> str:
    """``{"parse": 0.0012}`` -> ``parse;dur=1.200`` (the header's unit is milliseconds)."""
    return ", ".join(f"{name};dur={value * 1000:.3f}" for name, value in seconds.items())


def parse_server_timing(value: str) -> dict[str, float]:
    """The header back to seconds per phase; entries without a ``dur`` are skipped."""
    phases: dict[str, float] = {}
    for entry in value.split(","):
        name, _, params = entry.strip().partition(";")
        for param in params.split(";"):
            key, _, number = param.strip().partition("=")
            if name and key == "dur":
                try:
                    phases[name] = float(number) / 1000
                except ValueError:
                    continue
    return phases


# ----------------------------------------------------------------------------------------- sync
MAX_GROUP_TIMEOUT_S = 3600.0  # no init or transfer may hold the sync state longer
MAX_BUCKET_BYTES = 1 << 36  # 64 GiB: larger announcements are refused before any allocation
MAX_WEIGHT_VERSION = 2**62
_NAME_CHARS = 1024


class InitCommunicatorBody(WireModel):
    """swift's ``InitCommunicatorRequest`` plus the group backend and the rendezvous timeout.

    ``host`` is the server interface the weight-sync group listens on (the address the trainer
    reaches the server at; loopback when both share a host), never all interfaces.
    """

    host: str = Field(min_length=1, max_length=255)
    port: int = Field(gt=0, lt=65536)
    world_size: int = Field(gt=1, le=1024)
    client_device_uuid: str | None = Field(None, max_length=256)
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: float = Field(240.0, gt=0.0, le=MAX_GROUP_TIMEOUT_S)


class FlattenedTensorMeta(WireModel):
    """swift's ``FlattenedTensorMetadata``; ``start_idx``/``end_idx`` are byte offsets in the bucket."""

    name: str = Field(min_length=1, max_length=_NAME_CHARS)
    shape: list[Annotated[int, Field(ge=0, le=MAX_BUCKET_BYTES)]] = Field(max_length=16)
    dtype: str = Field(max_length=64)
    start_idx: int = Field(ge=0, le=MAX_BUCKET_BYTES)
    end_idx: int = Field(ge=0, le=MAX_BUCKET_BYTES)
    numel: int = Field(ge=0, le=MAX_BUCKET_BYTES)

    @field_validator("dtype")
    @classmethod
    def _plain_dtype(cls, value: str) -> str:
        return value.removeprefix("torch.")

    @model_validator(mode="after")
    def _consistent(self) -> FlattenedTensorMeta:
        if math.prod(self.shape) != self.numel:
            raise ValueError(f"tensor {self.name!r}: numel {self.numel} but shape {self.shape}")
        if self.end_idx < self.start_idx:
            raise ValueError(f"tensor {self.name!r}: end_idx {self.end_idx} < start_idx {self.start_idx}")
        return self


class TransactionHeader(WireModel):
    """Which update a bucket belongs to (absent: a swift-style update, applied as it arrives)."""

    version: int = Field(ge=0, le=MAX_WEIGHT_VERSION)
    mode: Literal["full", "adapter"]
    bucket_index: int = Field(ge=0, le=1 << 20)
    num_bytes: int = Field(gt=0, le=MAX_BUCKET_BYTES)


class UpdateFlattenedParamsBody(WireModel):
    metadatas: list[FlattenedTensorMeta] = Field(max_length=1 << 20)
    transaction: TransactionHeader | None = None


class UpdateAdapterBody(WireModel):
    lora_int_id: int = Field(ge=1, le=2**31 - 1)
    peft_config: dict[str, Any]
    metadatas: list[FlattenedTensorMeta] = Field(max_length=1 << 20)
    transaction: TransactionHeader | None = None


class FinishUpdateBody(WireModel):
    """The sender's account of an update: what the receiver must have got, bucket by bucket."""

    version: int = Field(ge=0, le=MAX_WEIGHT_VERSION)
    mode: Literal["full", "adapter"]
    bucket_checksums: list[Annotated[str, Field(max_length=64)]] = Field(max_length=1 << 20)
    checksum: str = Field(max_length=64)


class FinishUpdateReply(BaseModel):
    """The receiver's account: what it got and the version it serves now (or kept, on failure)."""

    ok: bool
    version: int
    checksum: str
    bucket_checksums: list[str]
    num_bytes: int
    num_tensors: int
    error: str | None = None


# ----------------------------------------------------------------------------------------- info
class ImageProbe(BaseModel):
    """How the server's processor resizes a fixed probe image (``data.prompts.image_probe``)."""

    size: tuple[int, int]  # (W, H) of the probe
    resized: tuple[int, int]  # (W, H) after the resize: the `pixels` frame of such an image
    image_tokens: int


class ServerInfo(BaseModel):
    """``GET /info/``: what the trainer cross-checks at start-up, plus serving facts."""

    protocol_version: int = PROTOCOL_VERSION
    engine: str
    model_dir: str
    fingerprint: dict[str, str]
    dtype: str
    max_model_len: int
    world_size: int
    weight_version: int
    sync_modes: list[str]
    # the `custom.object_format`s this server's tokenizer can decode (coord_tokens needs its tokens)
    object_formats: list[str] = Field(default_factory=lambda: ["qwen_json"])
    # The frame and resize the server serves (None: a server from before these fields; not compared).
    coord_frame: str | None = None  # `rollmatch serve --coord-frame`, resolved (norm1000 / pixels)
    min_pixels: int | None = None  # the processor's resize bounds (`--min-pixels` / `--max-pixels`)
    max_pixels: int | None = None
    image_probe: ImageProbe | None = None


class ServerHealth(BaseModel):
    """``GET /health/`` (200 when ``status`` is ``ok``, else 503): engine state and queue depth.

    ``engine`` is ``idle``, ``generating``, ``updating`` (a weight load or cache reset pending or
    running), ``stalled`` or ``stopped``; ``operation`` the engine operation under way, if any."""

    status: Literal["ok", "stalled", "broken"]
    engine: str
    operation: str | None = None
    weight_version: int
    queued_calls: int
    running_calls: int
    outstanding_prompts: int
    pending_operations: int
    detail: str | None = None


class ServerStats(BaseModel):
    """``GET /stats/``: counters for monitoring and tests."""

    weight_version: int
    pushes_by_version: dict[int, int]
    failed_pushes: int  # rejected at finish, or abandoned (abandoned_pushes counts those)
    abandoned_pushes: int = 0  # staged buckets never finished: freed after the group timeout
    infer_requests: int
    infer_calls: int
    rejected_requests: int = 0  # 4xx answers of /infer/
    busy_refusals: int = 0  # calls refused with 429 (queue full) or 503 (engine stalled)
    rerun_calls: int = 0  # calls aborted by a weight update and run again under the new weights
    update_mode: str = "drain"
    communicator: str


# ---------------------------------------------------------------------------------- fingerprint
# Config keys that differ between a checkpoint and the same model loaded for training or serving.
_VOLATILE_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "use_cache",
        "_commit_hash",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "attn_implementation",
        "architectures",
    }
)
FINGERPRINT_KEYS = ("architecture", "model_type", "config", "tokenizer", "chat_template", "processor")


def model_fingerprint(config: Any, processor: Any) -> dict[str, str]:
    """What trainer and server must share: architecture, config, tokenizer, chat template, processor.

    ``config`` is a transformers ``PretrainedConfig``; ``processor`` the model's ``AutoProcessor``
    (with the image-size settings actually used). Hashes are sha256 prefixes of canonical JSON.
    """
    tokenizer = getattr(processor, "tokenizer", processor)
    image_processor = getattr(processor, "image_processor", None)
    architectures = getattr(config, "architectures", None) or [type(config).__name__]
    template = getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None) or ""
    return {
        "architecture": str(architectures[0]),
        "model_type": str(getattr(config, "model_type", "")),
        "config": _digest(_without_volatile(config.to_dict())),
        "tokenizer": _digest(_tokenizer_state(tokenizer)),
        "chat_template": _digest(template),
        "processor": _digest(_without_volatile(image_processor.to_dict()) if image_processor else {}),
    }


def fingerprint_mismatches(local: dict[str, str], remote: dict[str, str]) -> list[str]:
    """Human-readable ``key: trainer X vs server Y`` lines for every differing fingerprint entry."""
    return [
        f"{key}: trainer {local.get(key)!r} vs server {remote.get(key)!r}"
        for key in FINGERPRINT_KEYS
        if local.get(key) != remote.get(key)
    ]


def _tokenizer_state(tokenizer: Any) -> Any:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.to_str()
    return sorted(tokenizer.get_vocab().items())


def _without_volatile(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_volatile(v) for k, v in value.items() if k not in _VOLATILE_CONFIG_KEYS}
    if isinstance(value, list | tuple):
        return [_without_volatile(v) for v in value]
    return value


def _digest(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
