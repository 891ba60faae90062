"""Seeing through model wrappers, in one place.

- :func:`strip_parallel_wrappers`: DDP / DataParallel / DeepSpeed engine / ``torch.compile`` ->
  the module they wrap. PEFT is kept: generation and adapter export need the PEFT model.
- :func:`transformers_model`: additionally through PEFT, down to the transformers model (for
  model-specific helpers such as ``get_rope_index`` or the attention implementation).
"""

from __future__ import annotations

from typing import Any

from torch import nn


def strip_parallel_wrappers(model: nn.Module) -> nn.Module:
    """Strip DDP / DataParallel / DeepSpeed / ``torch.compile`` wrappers (not PEFT)."""
    while True:
        if (
            isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel)
            or type(model).__name__ == "DeepSpeedEngine"
        ):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def transformers_model(model: nn.Module) -> Any:
    """The transformers model inside parallel wrappers and PEFT (``get_base_model``)."""
    current: Any = strip_parallel_wrappers(model)
    while hasattr(current, "get_base_model"):  # peft.PeftModel
        current = strip_parallel_wrappers(current.get_base_model())
    return current
