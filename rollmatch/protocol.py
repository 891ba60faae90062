"""Wire models of the rollout server, shared by the server (``server.app``) and its client.

Owns: the JSON shapes of every endpoint (pydantic), images on the wire (base64 PNG out, base64 /
data URL / local path in), and conversion between :class:`~rollmatch.rollout.types.Decoding` and
ms-swift's ``request_config``. Leaves out: engines, HTTP plumbing and the transfer of tensors.

Compatibility with ms-swift's ``swift rollout``: ``POST /infer/`` accepts ``infer_requests``
(``messages`` + ``images``) and ``request_config`` (``max_tokens``, ``temperature``, ``top_p``,
``top_k``, ``repetition_penalty``, ``seed``, ``stop``, ``return_details``, ...) and answers a JSON
list of ``RolloutOutput`` items whose ``response`` is a ``ChatCompletionResponse`` with
``prompt_token_ids`` and per-choice ``token_ids`` / ``finish_reason``. Additions: a request may
carry the trainer's ``prompt_token_ids`` (used verbatim, never re-tokenized), every item carries
``weight_version``, and weight updates are transactions ending in ``/finish_weight_update/``.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollmatch.rollout.types import Decoding

if TYPE_CHECKING:
    from PIL.Image import Image

PROTOCOL_VERSION = 1


class WireModel(BaseModel):
    """Base of every wire model: unknown fields are errors (a typo never passes silently)."""

    model_config = ConfigDict(extra="forbid")


# ------------------------------------------------------------------------------------------- infer
class RequestConfig(WireModel):
    """ms-swift's ``RequestConfig``. ``None`` means the server default (greedy, all the room left)."""

    max_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0.0)
    top_k: int | None = None
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: int | None = None
    stop: list[str] | None = Field(default_factory=list)
    return_details: bool = False
    # Accepted because swift's client sends them; only their defaults are implemented.
    num_beams: int = 1
    n: int = 1
    stream: bool = False
    logprobs: bool = False
    top_logprobs: int | None = None
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    length_penalty: float = 1.0
    structured_outputs_regex: str | None = None

    @model_validator(mode="after")
    def _only_implemented_options(self) -> RequestConfig:
        defaults = {
            "num_beams": 1,
            "n": 1,
            "stream": False,
            "logprobs": False,
            "top_logprobs": None,
            "best_of": None,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "length_penalty": 1.0,
            "structured_outputs_regex": None,
        }
        for key, default in defaults.items():
            if getattr(self, key) != default:
                raise ValueError(
                    f"request_config.{key} = {getattr(self, key)!r} is not supported by the rollmatch rollout "
                    f"server; send {default!r} (or omit it)"
                )
        return self


class InferRequest(WireModel):
    """One prompt: chat ``messages`` + ``images`` (swift), and/or the trainer's ``prompt_token_ids``.

    With ``prompt_token_ids`` the ids are used as given and ``messages`` are ignored; the images
    must be the ones whose placeholders the ids contain.
    """

    messages: list[dict[str, Any]] = Field(default_factory=list)
    images: list[str] = Field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    sample_id: str | None = None
    # swift fields with no meaning for detection rollouts: accepted when empty.
    audios: list[str] = Field(default_factory=list)
    videos: list[str] = Field(default_factory=list)
    tools: list[Any] | None = None
    objects: dict[str, Any] = Field(default_factory=dict)
    data_dict: dict[str, Any] = Field(default_factory=dict)
    uuid: str | None = None

    @model_validator(mode="after")
    def _has_a_prompt(self) -> InferRequest:
        if not self.messages and not self.prompt_token_ids:
            raise ValueError("an infer request needs `messages` or `prompt_token_ids`")
        if self.audios or self.videos or self.tools:
            raise ValueError("audios, videos and tools are not supported by the rollmatch rollout server")
        return self


class InferBody(WireModel):
    """Body of ``POST /infer/``; ``metrics``/``template``/``use_tqdm``/``adapter_request`` are swift's."""

    infer_requests: list[InferRequest]
    request_config: RequestConfig | None = None
    metrics: Any = None
    template: Any = None
    use_tqdm: bool | None = None
    adapter_request: Any = None


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None
    token_ids: list[int] | None = None  # stop-trimmed response ids (with return_details)


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


class RolloutOutput(BaseModel):
    """One item of the ``/infer/`` reply: swift's ``RolloutOutput`` plus ``weight_version``."""

    response: ChatCompletionResponse
    messages: list[dict[str, Any]] | None = None
    response_token_ids: list[list[int]] = Field(default_factory=list)
    response_loss_mask: list[list[int]] = Field(default_factory=list)
    rollout_infos: dict[str, Any] = Field(default_factory=dict)
    rollout_logprobs: list[list[float]] = Field(default_factory=list)
    weight_version: int
    sample_id: str | None = None


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


def decoding_from_request_config(config: RequestConfig, room: int) -> Decoding:
    """Server side: swift's ``None`` defaults become greedy decoding with ``room`` new tokens."""
    if config.max_tokens is not None and config.max_tokens > room:
        raise ValueError(
            f"request_config.max_tokens = {config.max_tokens} leaves no room: the longest prompt allows "
            f"{room} new tokens within the server's max_model_len; lower max_tokens or serve with a larger "
            "--max-model-len"
        )
    return Decoding(
        temperature=0.0 if config.temperature is None else config.temperature,
        top_p=1.0 if config.top_p is None else config.top_p,
        top_k=-1 if config.top_k is None else config.top_k,
        repetition_penalty=1.0 if config.repetition_penalty is None else config.repetition_penalty,
        max_new_tokens=room if config.max_tokens is None else config.max_tokens,
    )


# ------------------------------------------------------------------------------------------ images
def encode_image(image: Image) -> str:
    """Base64 PNG: lossless, so the server's processor sees the trainer's exact pixels.

    Compression level 1: several times faster to write than the default, for ~10-20% more bytes.
    """
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_image(value: str) -> Image:
    """An RGB image from base64, a ``data:image/...;base64,`` URL or a local path on the server."""
    from PIL import Image as PILImage

    if value.startswith("data:"):
        value = value.split(",", 1)[1] if "," in value else ""
        raw = _b64(value)
    elif value.startswith(("http://", "https://")):
        raise ValueError(
            f"image URL {value[:80]!r}: the rollout server does not fetch URLs; send base64 or a local path"
        )
    elif len(value) < 4096 and Path(value).is_file():
        raw = Path(value).read_bytes()
    else:
        raw = _b64(value)
    try:
        with PILImage.open(io.BytesIO(raw)) as image:
            return image.convert("RGB")
    except OSError as exc:
        raise ValueError(f"image {value[:60]!r}...: not a decodable image ({exc})") from exc


def _b64(value: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except ValueError as exc:
        raise ValueError(
            f"image {value[:60]!r}...: neither a local file on the server nor valid base64 ({exc})"
        ) from exc


# ----------------------------------------------------------------------------------------- sync
class InitCommunicatorBody(WireModel):
    """swift's ``InitCommunicatorRequest`` plus the group backend and the rendezvous timeout."""

    host: str
    port: int = Field(gt=0, lt=65536)
    world_size: int = Field(gt=1)
    client_device_uuid: str | None = None
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: float = Field(240.0, gt=0.0)


class FlattenedTensorMeta(WireModel):
    """swift's ``FlattenedTensorMetadata``; ``start_idx``/``end_idx`` are byte offsets in the bucket."""

    name: str
    shape: list[int]
    dtype: str
    start_idx: int = Field(ge=0)
    end_idx: int = Field(ge=0)
    numel: int = Field(ge=0)

    @field_validator("dtype")
    @classmethod
    def _plain_dtype(cls, value: str) -> str:
        return value.removeprefix("torch.")


class TransactionHeader(WireModel):
    """Which update a bucket belongs to (absent: a swift-style update, applied as it arrives)."""

    version: int
    mode: Literal["full", "adapter"]
    bucket_index: int = Field(ge=0)
    num_bytes: int = Field(gt=0)


class UpdateFlattenedParamsBody(WireModel):
    metadatas: list[FlattenedTensorMeta]
    transaction: TransactionHeader | None = None


class UpdateAdapterBody(WireModel):
    lora_int_id: int
    peft_config: dict[str, Any]
    metadatas: list[FlattenedTensorMeta]
    transaction: TransactionHeader | None = None


class FinishUpdateBody(WireModel):
    """The sender's account of an update: what the receiver must have got, bucket by bucket."""

    version: int
    mode: Literal["full", "adapter"]
    bucket_checksums: list[str]
    checksum: str


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


class ServerStats(BaseModel):
    """``GET /stats/``: counters for monitoring and tests."""

    weight_version: int
    pushes_by_version: dict[int, int]
    failed_pushes: int
    infer_requests: int
    infer_calls: int
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
