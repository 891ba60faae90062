"""A model's fingerprint: digests of what must agree between the trainer's model and a server's."""

from __future__ import annotations

import hashlib
import json
from typing import Any

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
