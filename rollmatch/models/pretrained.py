"""Loading a saved Qwen-VL model directory as the config asks (dtype, attention kernel).

Owns: :data:`DTYPES` and :func:`load_pretrained`, shared by training (which then adds adapters,
``training.entry``) and evaluation. Leaves out: LoRA / packing set-up (training) and building tiny
models (``models.tiny``).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForImageTextToText

from rollmatch.config.schema import RollmatchConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_pretrained(cfg: RollmatchConfig) -> torch.nn.Module:
    """``model.path`` as saved, in the configured dtype and attention kernel (no adapters added)."""
    return AutoModelForImageTextToText.from_pretrained(
        cfg.model.path, dtype=DTYPES[cfg.model.dtype], attn_implementation=cfg.model.attn_implementation
    )
