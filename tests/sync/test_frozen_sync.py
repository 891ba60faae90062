"""Weight sync with frozen module groups: frozen tensors leave the export once the engine holds them."""

from __future__ import annotations

from pathlib import Path

import torch

from rollmatch.sync.weights import SyncTensors, flatten_buckets, frozen_parameter_names
from rollmatch.training.param_groups import freeze_groups, module_group


def _push_bytes(model: torch.nn.Module, *, skip_frozen: bool) -> tuple[int, set[str]]:
    """Bytes of the buckets one full push sends (what ``push_update`` transfers) and the names in them."""
    buckets = list(flatten_buckets(SyncTensors(model, "full", skip_frozen=skip_frozen), 1 << 20))
    return sum(b.num_bytes for b in buckets), {m.name for b in buckets for m in b.metas}


def test_frozen_groups_are_left_out_of_later_pushes(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir)
    full_bytes, full_names = _push_bytes(model, skip_frozen=True)  # nothing frozen yet: nothing skipped
    freeze_groups(model, ["vision_tower", "merger"])
    first_bytes, first_names = _push_bytes(model, skip_frozen=False)
    later_bytes, later_names = _push_bytes(model, skip_frozen=True)
    assert first_bytes == full_bytes and first_names == full_names
    assert later_names == {n for n in full_names if module_group(n) == "language_model"}
    frozen_bytes = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if not p.requires_grad
    )
    assert frozen_names_cover(model, full_names - later_names)
    # bucket alignment pads each tensor to 16 bytes: compare within that slack
    assert abs((first_bytes - later_bytes) - frozen_bytes) <= 16 * len(full_names - later_names)
    print(f"bytes per push: all {first_bytes}, frozen vision tower + merger left out {later_bytes}")


def frozen_names_cover(model: torch.nn.Module, names: set[str]) -> bool:
    return names == frozen_parameter_names(model)
