"""The run's settings saved beside its weights (``rollmatch_run.json``), so they travel with them.

Owns: :data:`RUN_FILE` and its versioned content (:func:`run_settings`, :func:`write_run_file`,
:func:`read_run_file`) and :func:`run_layer`, the config layer it becomes when ``eval``, ``diagnose``,
``preflight``, ``serve``, ``export`` or a resumed ``train`` loads a directory that has one: it sits
under ``--config`` and the command line's overrides, which only override it. The content is what
decoding and scoring a model needs and a config could get wrong: object format, resolved coordinate
frame, prompt and class names, pixel bounds, coordinate tokens, the answer budget. It names no
machine path (the weights' folder may be copied anywhere).

Leaves out: writing it into checkpoints (``training``), the model card (``models.export``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rollmatch.config.resolved import ResolvedRun
from rollmatch.errors import ConfigError, ConfigProblem

RUN_FILE = "rollmatch_run.json"
RUN_FILE_VERSION = 1
# The settings a model's answers depend on: a resumed run refuses to change them (the weights were
# trained for them), eval / diagnose / serve take them unless a config overrides them.
DECODE_KEYS = (
    "custom.object_format",
    "data.coord_frame",
    "data.prompt",
    "data.labels",
    "data.prompt_max_labels",
    "data.min_pixels",
    "data.max_pixels",
)


def run_settings(
    run: ResolvedRun,
    *,
    labels: list[str] | None,
    pixel_bounds: tuple[int, int],
    coord_token_ids: list[int] | None,
) -> dict[str, Any]:
    """The content of ``rollmatch_run.json`` for ``run`` (``pixel_bounds``: the processor's in force,
    ``coord_token_ids``: ids of ``<|coord_0|>``.. when the tokenizer has them)."""
    cfg = run.config
    coord = None
    if coord_token_ids is not None:
        coord = {
            "tokens": "<|coord_0|> .. <|coord_999|>",
            "first_id": coord_token_ids[0],
            "last_id": coord_token_ids[-1],
            "bins": len(coord_token_ids),
            "to_norm1000": "value = round(k * 1000 / 999) for <|coord_k|>, 0..1000 of the image",
            "used": cfg.custom.object_format == "coord_tokens",
        }
    settings: dict[str, Any] = {
        "custom.object_format": cfg.custom.object_format,
        "data.coord_frame": run.coord_frame,
        "data.prompt": cfg.data.prompt,
        "data.labels": labels,
        "data.prompt_max_labels": cfg.data.prompt_max_labels,
        "data.min_pixels": pixel_bounds[0],
        "data.max_pixels": pixel_bounds[1],
        "eval.max_new_tokens": run.eval_decoding.max_new_tokens,
        "training.seed": cfg.training.seed,
    }
    # a model trained with noise objects answers them: its evaluations drop them (eval.noise_label)
    noise_label = cfg.eval.noise_label or (
        cfg.loss.noise_objects.label if cfg.loss.noise_objects.enabled else None
    )
    if noise_label is not None:
        settings["eval.noise_label"] = noise_label
    return {
        "rollmatch_run_version": RUN_FILE_VERSION,
        "trainer_variant": cfg.custom.trainer_variant,
        "objective": cfg.loss.objective,
        "settings": settings,
        "coord_tokens": coord,
    }


def write_run_file(folder: str | Path, settings: dict[str, Any]) -> Path:
    """Write ``settings`` (from :func:`run_settings`) into ``folder``."""
    path = Path(folder) / RUN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def read_run_file(folder: str | Path) -> dict[str, Any] | None:
    """The run settings saved in ``folder`` (None when it has none); a file of a newer version or
    without its keys is an error naming it."""
    path = Path(folder) / RUN_FILE
    if not path.is_file():
        return None
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(
            [ConfigProblem(RUN_FILE, str(path), f"not valid JSON ({exc}); restore it")]
        ) from exc
    version = content.get("rollmatch_run_version") if isinstance(content, dict) else None
    if not isinstance(version, int) or version > RUN_FILE_VERSION or "settings" not in content:
        raise ConfigError(
            [
                ConfigProblem(
                    RUN_FILE,
                    str(path),
                    f"version {version!r}: this rollmatch reads version <= {RUN_FILE_VERSION} with a "
                    "`settings` mapping; upgrade rollmatch or pass the settings with --config",
                )
            ]
        )
    return content


def run_layer(content: dict[str, Any]) -> dict[str, Any]:
    """The saved settings as a nested config mapping (a layer under the user's config)."""
    layer: dict[str, Any] = {}
    for key, value in content["settings"].items():
        *parents, leaf = key.split(".")
        node = layer
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return layer


def describe(content: dict[str, Any]) -> str:
    """One line saying what the saved settings fix (printed by the commands that use them)."""
    s = content["settings"]
    labels = s.get("data.labels")
    return (
        f"object_format {s['custom.object_format']}, coord_frame {s['data.coord_frame']}, "
        f"pixels {s['data.min_pixels']}..{s['data.max_pixels']}, "
        + (f"{len(labels)} class names" if labels else "no class list")
    )


def changed_settings(content: dict[str, Any], current: dict[str, Any]) -> list[ConfigProblem]:
    """The :data:`DECODE_KEYS` whose value in ``current`` (a :func:`run_settings` of the resumed run)
    differs from the checkpoint's, one problem each."""
    saved, now = content["settings"], current["settings"]
    return [
        ConfigProblem(
            key,
            now.get(key),
            f"the checkpoint was trained with {saved.get(key)!r} ({RUN_FILE}); resume with the same value "
            "or start a new run (another output_dir) from the checkpoint's weights",
        )
        for key in DECODE_KEYS
        if key in saved and saved.get(key) != now.get(key)
    ]
