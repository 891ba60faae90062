"""The coordinate frame a run serializes boxes in: ``data.coord_frame``, with ``auto`` resolved.

Owns: the frame each supported model family was pretrained in (:data:`FAMILY_FRAMES`), reading a
checkpoint's family (``model_type`` of its ``config.json``: plain JSON, no transformers) and
:func:`resolve_coord_frame`, the one resolution used by training targets, evaluation, the rollout
server (``rollmatch serve --coord-frame``) and ``check-config``. Leaves out: converting boxes
between frames (``detection.objects``) and the processor resize (``data.prompts``).

Rules: an explicit ``norm1000`` / ``pixels`` always wins. ``auto`` with ``custom.object_format:
coord_tokens`` is ``norm1000`` whatever the family: the coordinate tokens are a frame of their own
(bin ``k`` = ``k/999`` of the side), new to every checkpoint, so no pretraining frame applies.
Otherwise ``auto`` is the family's pretraining frame: Qwen2.5-VL pixels of the processor-resized
image, Qwen2-VL and Qwen3-VL (dense and MoE: ``qwen3_vl_moe``) 0..1000. Another ``model_type`` is refused with the fix (set it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from rollmatch.errors import ConfigError, ConfigProblem

Frame = Literal["norm1000", "pixels"]  # = rollmatch.detection.objects.CoordFrame
FrameSetting = Literal["auto", "norm1000", "pixels"]
FAMILY_FRAMES: dict[str, Frame] = {
    "qwen2_vl": "norm1000",
    "qwen2_5_vl": "pixels",
    "qwen3_vl": "norm1000",
    "qwen3_vl_moe": "norm1000",  # Qwen3-VL 30B-A3B / 235B-A22B: the Qwen3-VL frame
}


def resolve_coord_frame(
    setting: FrameSetting | str, model_dir: str | Path, *, object_format: str = "qwen_json"
) -> Frame:
    """The concrete frame of ``data.coord_frame`` for the checkpoint in ``model_dir`` (see the module
    docstring); raises :class:`ConfigError` naming ``data.coord_frame`` when ``auto`` cannot resolve."""
    fixed = fixed_coord_frame(setting, object_format)
    if fixed is not None:
        return fixed
    family = model_family(model_dir)
    frame = FAMILY_FRAMES.get(family)
    if frame is None:
        raise ConfigError(
            [
                ConfigProblem(
                    "data.coord_frame",
                    "auto",
                    f"model_type {family!r} of {Path(model_dir) / 'config.json'} is not a family with a known "
                    f"pretraining frame ({', '.join(FAMILY_FRAMES)}); set data.coord_frame: norm1000 or pixels",
                )
            ]
        )
    return frame


def fixed_coord_frame(setting: FrameSetting | str, object_format: str = "qwen_json") -> Frame | None:
    """The frame when it needs no checkpoint (explicit, or ``auto`` with coord tokens), else ``None``."""
    if setting in ("norm1000", "pixels"):
        return setting  # type: ignore[return-value]
    if setting != "auto":
        raise ConfigError([ConfigProblem("data.coord_frame", setting, "use one of auto, norm1000, pixels")])
    return "norm1000" if object_format == "coord_tokens" else None


def model_family(model_dir: str | Path) -> str:
    """``model_type`` of ``model_dir/config.json`` (``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``, ...)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(
            [
                ConfigProblem(
                    "model.path",
                    str(model_dir),
                    f"data.coord_frame: auto reads the model family from {path} ({type(exc).__name__}: {exc}); "
                    "point model.path at a Hugging Face model directory, or set data.coord_frame explicitly",
                )
            ]
        ) from exc
    return str(config.get("model_type", "")) if isinstance(config, dict) else ""


def describe_coord_frame(setting: str, model_dir: str | Path, object_format: str = "qwen_json") -> str:
    """One line for ``check-config``: what ``data.coord_frame`` resolves to, and why."""
    fixed = fixed_coord_frame(setting, object_format)
    if fixed is not None:
        why = "set explicitly" if setting != "auto" else "auto with custom.object_format: coord_tokens"
        return f"data.coord_frame: {fixed} ({why})"
    if not (Path(model_dir) / "config.json").is_file():
        return (
            f"data.coord_frame: auto (resolved from {Path(model_dir) / 'config.json'} when the run starts; "
            "that file does not exist yet)"
        )
    frame = resolve_coord_frame(setting, model_dir, object_format=object_format)
    return f"data.coord_frame: auto -> {frame} (model_type {model_family(model_dir)!r} of {model_dir})"
