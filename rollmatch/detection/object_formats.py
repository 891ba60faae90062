"""The object formats by name (``custom.object_format``) and the codec each one builds.

Owns: :data:`OBJECT_FORMATS` (name -> codec class) and :func:`build_codec`. It sits above both codec
modules (``detection.codec`` holds ``qwen_json``, ``detection.coord_tokens`` the ``coord_tokens``
codec built on it), so neither imports the other's registry. Leaves out: how a format serializes
or parses (the codec modules) and which formats a tokenizer supports
(``detection.coord_tokens.supported_object_formats``).
"""

from __future__ import annotations

from collections.abc import Sequence

from rollmatch.detection.codec import ObjectCodec, QwenJsonCodec, Tokenizer
from rollmatch.detection.coord_tokens import CoordTokenCodec
from rollmatch.errors import ConfigError, ConfigProblem

OBJECT_FORMATS: dict[str, type[QwenJsonCodec]] = {
    QwenJsonCodec.name: QwenJsonCodec,
    CoordTokenCodec.name: CoordTokenCodec,
}


def build_codec(name: str, tokenizer: Tokenizer, eos_token_ids: Sequence[int]) -> ObjectCodec:
    """The codec named by ``custom.object_format``."""
    if name not in OBJECT_FORMATS:
        raise ConfigError(
            [ConfigProblem("custom.object_format", name, f"use one of {sorted(OBJECT_FORMATS)}")]
        )
    return OBJECT_FORMATS[name](tokenizer, eos_token_ids)
