"""``POST /infer/``: the request body (ms-swift's ``RolloutInferRequest`` / ``RequestConfig``
fields, each range checked at the wire), the reply items, and conversion between
:class:`~rollmatch.config.decoding.Decoding` and ``request_config``.
Leaves out: the server's configurable caps (``server.limits``) and media policy (``server.media``).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StrictBool, TypeAdapter, field_validator, model_validator

from rollmatch.config.decoding import Decoding
from rollmatch.protocol.wire import WireModel

# Absolute wire bounds; the server adds its own configurable caps (``rollmatch serve --max-*``).
SEED_MAX = 2**63 - 1  # every engine seeds a torch.Generator with an int64 (request j uses seed + j)
TEMPERATURE_MIN, TEMPERATURE_MAX = 0.01, 100.0  # besides 0 (greedy): no overflow in logits / T
PENALTY_MIN, PENALTY_MAX = 0.01, 100.0
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
MAX_SAMPLE_ID_CHARS = 256
TOKEN_ID_MAX = 2**31 - 1
# Counts, refused while the body is parsed (a list's items are built before its length is checked:
# the server's `--max-json-values` bounds that before parsing); the server's
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
    "top_logprobs": (None, 0),
    "prompt_logprobs": None,
    "min_p": (None, 0.0),
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "length_penalty": 1.0,
    "structured_outputs_regex": None,
}


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
        default_factory=list, max_length=MAX_STOP_STRINGS, fail_fast=True
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
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS, fail_fast=True)]

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

    messages: list[ChatTurn] = Field(
        default_factory=list, max_length=MAX_MESSAGES_PER_REQUEST, fail_fast=True
    )
    images: list[str] = Field(default_factory=list, max_length=MAX_IMAGES_PER_REQUEST, fail_fast=True)
    prompt_token_ids: list[Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]] | None = Field(None, fail_fast=True)
    sample_id: str | None = Field(None, max_length=MAX_SAMPLE_ID_CHARS)
    # swift fields with no meaning for detection rollouts: accepted when empty.
    audios: list[str] = Field(default_factory=list, fail_fast=True)
    videos: list[str] = Field(default_factory=list, fail_fast=True)
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

    infer_requests: list[InferRequest] = Field(max_length=MAX_INFER_REQUESTS, fail_fast=True)
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
    # With request_config.logprobs: {"content": [{"token", "logprob", "bytes", "top_logprobs"}, ...]}, one
    # entry per sampled token (the response's, then the stop token's when it stopped on one).
    logprobs: dict[str, list[dict[str, Any]]] | None = None
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
    rollout_logprobs: list[list[float]] = Field(default_factory=list)  # [the choice's logprob values]
    prompt_logprobs: None = None
    weight_version: int  # the oldest weight version that produced this output
    weight_version_last: int | None = None  # the newest; differs only under `serve --update-mode keep`
    sample_id: str | None = None


# The whole ``/infer/`` reply: serialised by the server and parsed by the client in one pass each
# (pydantic's JSON encoder / parser, no intermediate Python dicts).
INFER_REPLY = TypeAdapter(list[RolloutOutput])


def request_config_from_decoding(decoding: Decoding, seed: int | None) -> RequestConfig:
    """The ``request_config`` that asks a server for exactly ``decoding`` (token ids and the sampled
    tokens' log-probs included)."""
    return RequestConfig(
        max_tokens=decoding.max_new_tokens,
        temperature=decoding.temperature,
        top_k=decoding.top_k,
        top_p=decoding.top_p,
        repetition_penalty=decoding.repetition_penalty,
        seed=seed,
        logprobs=True,
        return_details=True,
    )


def logprob_content(token_ids: list[int], values: list[float]) -> dict[str, list[dict[str, Any]]]:
    """The swift / OpenAI ``choice.logprobs`` of sampled tokens (``token`` as ``token_id:<id>``, as vLLM's
    OpenAI server writes it with ``return_tokens_as_token_ids``; no alternatives)."""
    return {
        "content": [
            {"token": f"token_id:{token}", "logprob": value, "bytes": None, "top_logprobs": []}
            for token, value in zip(token_ids, values, strict=True)
        ]
    }


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
