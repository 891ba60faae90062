"""Wire models of the rollout server, shared by the server (``server.app``) and its client.

Owns, one module per concern, every name re-exported here: the JSON shapes of every endpoint
(pydantic) with the range of every number, checked at the wire before anything reaches an engine
(``wire``: the base model; ``infer``: ``/infer/`` bodies and replies, and conversion between
:class:`~rollmatch.config.decoding.Decoding` and ms-swift's ``request_config``; ``sync``: the
weight-sync bodies; ``info``: ``/info/``, ``/health/``, ``/stats/``; ``auth``: credential header and
environment-variable names), base64 and the default image
encoding (``image_base64``), the ``Server-Timing`` header of ``/infer/`` answers (``server_timing``) and the
model fingerprint the trainer and a server compare (``fingerprint``).
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

from rollmatch.protocol.auth import (
    API_KEY_ENV,
    LEASE_HEADER,
    SYNC_KEY_ENV,
    SYNC_KEY_HEADER,
)
from rollmatch.protocol.fingerprint import (
    FINGERPRINT_KEYS,
    fingerprint_mismatches,
    model_fingerprint,
)
from rollmatch.protocol.image_base64 import (
    encode_image,
    from_base64,
    to_base64,
)
from rollmatch.protocol.infer import (
    INFER_REPLY,
    MAX_CONTENT_PARTS,
    MAX_IMAGES_PER_REQUEST,
    MAX_INFER_REQUESTS,
    MAX_MESSAGES_PER_REQUEST,
    MAX_SAMPLE_ID_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MESSAGE_ROLES,
    PENALTY_MAX,
    PENALTY_MIN,
    SEED_MAX,
    TEMPERATURE_MAX,
    TEMPERATURE_MIN,
    TEMPLATE_FLAGS,
    TOKEN_ID_MAX,
    ChatChoice,
    ChatCompletionResponse,
    ChatMessage,
    ChatTurn,
    ContentPart,
    ImagePart,
    ImageUrl,
    InferBody,
    InferRequest,
    RequestConfig,
    RolloutOutput,
    TextPart,
    Usage,
    decoding_from_request_config,
    logprob_content,
    request_config_from_decoding,
)
from rollmatch.protocol.info import (
    PROTOCOL_VERSION,
    ImageProbe,
    ServerHealth,
    ServerInfo,
    ServerStats,
)
from rollmatch.protocol.server_timing import (
    SERVER_TIMING_HEADER,
    format_server_timing,
    parse_server_timing,
)
from rollmatch.protocol.sync import (
    MAX_BUCKET_BYTES,
    MAX_GROUP_TIMEOUT_S,
    MAX_WEIGHT_VERSION,
    SYNC_STATE_CHANGES,
    FinishUpdateBody,
    FinishUpdateReply,
    FlattenedTensorMeta,
    InitCommunicatorBody,
    InitCommunicatorReply,
    TransactionHeader,
    UpdateAdapterBody,
    UpdateFlattenedParamsBody,
)
from rollmatch.protocol.wire import (
    WireModel,
)

__all__ = [
    "API_KEY_ENV",
    "FINGERPRINT_KEYS",
    "INFER_REPLY",
    "LEASE_HEADER",
    "MAX_BUCKET_BYTES",
    "MAX_CONTENT_PARTS",
    "MAX_GROUP_TIMEOUT_S",
    "MAX_IMAGES_PER_REQUEST",
    "MAX_INFER_REQUESTS",
    "MAX_MESSAGES_PER_REQUEST",
    "MAX_SAMPLE_ID_CHARS",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "MAX_WEIGHT_VERSION",
    "MESSAGE_ROLES",
    "PENALTY_MAX",
    "PENALTY_MIN",
    "PROTOCOL_VERSION",
    "SEED_MAX",
    "SERVER_TIMING_HEADER",
    "SYNC_KEY_ENV",
    "SYNC_KEY_HEADER",
    "SYNC_STATE_CHANGES",
    "TEMPERATURE_MAX",
    "TEMPERATURE_MIN",
    "TEMPLATE_FLAGS",
    "TOKEN_ID_MAX",
    "ChatChoice",
    "ChatCompletionResponse",
    "ChatMessage",
    "ChatTurn",
    "ContentPart",
    "FinishUpdateBody",
    "FinishUpdateReply",
    "FlattenedTensorMeta",
    "ImagePart",
    "ImageProbe",
    "ImageUrl",
    "InferBody",
    "InferRequest",
    "InitCommunicatorBody",
    "InitCommunicatorReply",
    "RequestConfig",
    "RolloutOutput",
    "ServerHealth",
    "ServerInfo",
    "ServerStats",
    "TextPart",
    "TransactionHeader",
    "UpdateAdapterBody",
    "UpdateFlattenedParamsBody",
    "Usage",
    "WireModel",
    "decoding_from_request_config",
    "encode_image",
    "fingerprint_mismatches",
    "format_server_timing",
    "from_base64",
    "logprob_content",
    "model_fingerprint",
    "parse_server_timing",
    "request_config_from_decoding",
    "to_base64",
]
