"""``rollmatch export --checkpoint DIR --out DIR``: a training checkpoint as a standalone model folder.

Owns: :func:`export_checkpoint`. The folder holds the merged weights (LoRA / DoRA adapters merged
into the base with PEFT's ``merge_and_unload`` in float32, then saved in the base checkpoint's dtype),
the processor and tokenizer (with the coordinate tokens when the checkpoint has them, and the run's
pixel bounds) and its chat template, the run's settings (``rollmatch_run.json``: object format, frame,
prompt, class names, pixel bounds; ``rollmatch eval --model`` reads them) and a ``README.md`` model
card that says how to prompt it and read its boxes, with the checkpoint's evaluation figures (the last
``eval/*`` entry of its ``trainer_state.json``). Nothing in the folder names a path of this machine.
It loads with ``from_pretrained`` and serves with ``vllm serve`` / ``rollmatch serve``.

Where the processor comes from: ``processor_dir`` when given, else the checkpoint itself when it has
a tokenizer (``final/`` does), else the LoRA base model (``adapter_config.json``). A full-weight
``checkpoint-N`` has none: pass the model directory the run started from.
Leaves out: sharded (ZeRO-3 / FSDP) checkpoints, which HF saves per rank; export ``final/``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rollmatch.config.run_file import RUN_FILE, read_run_file, write_run_file
from rollmatch.errors import ConfigError, ConfigProblem

TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


def export_command(args: argparse.Namespace) -> int:
    out = export_checkpoint(args.checkpoint, args.out, processor_dir=args.processor)
    print(f"exported {args.checkpoint} -> {out} (model card: {out / 'README.md'})")
    return 0


def export_checkpoint(
    checkpoint: str | Path, out: str | Path, *, processor_dir: str | Path | None = None
) -> Path:
    """Write the merged model, its processor (chat template included) and a model card to ``out``."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    src, out = Path(checkpoint), Path(out)
    if not src.is_dir():
        raise _problem("--checkpoint", str(src), "not a directory; pass a checkpoint-N or final/ folder")
    adapter_config = _read_json(src / "adapter_config.json")
    base_dir = adapter_config.get("base_model_name_or_path") if adapter_config else None
    settings = read_run_file(src)
    if adapter_config:
        from peft import PeftModel

        base = AutoModelForImageTextToText.from_pretrained(base_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, str(src)).merge_and_unload()  # merged in float32
        model = model.to(saved_dtype(Path(base_dir)))
    elif (src / "config.json").is_file():
        model = AutoModelForImageTextToText.from_pretrained(src, dtype="auto")
    else:
        raise _problem(
            "--checkpoint", str(src), "has neither config.json (full weights) nor adapter_config.json"
        )
    processor = AutoProcessor.from_pretrained(str(_processor_source(src, base_dir, processor_dir)))
    if settings is not None:  # the run's pixel bounds, whichever folder the processor came from
        s = settings["settings"]
        processor.image_processor.size = {
            "shortest_edge": s["data.min_pixels"],
            "longest_edge": s["data.max_pixels"],
        }
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    if settings is not None:
        write_run_file(out, settings)
    card = model_card(src, adapter_config is not None, processor, settings)
    (out / "README.md").write_text(card, encoding="utf-8")
    return out


def saved_dtype(model_dir: Path) -> Any:
    """The dtype a checkpoint's weights were saved in (``config.json``), float32 when it names none."""
    import torch

    config = _read_json(model_dir / "config.json") or {}
    name = config.get("dtype") or config.get("torch_dtype") or config.get("text_config", {}).get("dtype")
    return getattr(torch, name) if isinstance(name, str) and hasattr(torch, name) else torch.float32


def last_eval_figures(checkpoint: Path) -> dict[str, float]:
    """The last logged ``eval/*`` metrics of a checkpoint's ``trainer_state.json`` ({} when none)."""
    state = _read_json(checkpoint / "trainer_state.json") or {}
    for entry in reversed(state.get("log_history", [])):
        figures = {
            k: v for k, v in entry.items() if k.startswith(("eval/", "eval_")) and isinstance(v, int | float)
        }
        if figures:
            return {"step": entry.get("step", state.get("global_step")), **figures}
    return {}


def model_card(
    checkpoint: Path, merged_lora: bool, processor: Any, settings: dict[str, Any] | None = None
) -> str:
    """The README of an exported folder: provenance (no machine path), how to prompt it and read its
    boxes (``settings``: the run's ``rollmatch_run.json``), how to load it, the evaluation figures."""
    figures = last_eval_figures(checkpoint)
    lines = [
        "# Detection model trained with rollmatch",
        "",
        f"Exported from a rollmatch checkpoint (`{checkpoint.name}/`)"
        + (", LoRA adapters merged into the base weights." if merged_lora else "."),
        "",
        *usage_lines(settings, coord="<|coord_0|>" in processor.tokenizer.get_vocab()),
        "",
        "```bash",
        "vllm serve THIS_DIR     # or: rollmatch serve --model THIS_DIR",
        f"rollmatch eval --model THIS_DIR --data val.jsonl    # reads {RUN_FILE}: no --config needed",
        "```",
        "",
        "## Evaluation (the checkpoint's last in-training evaluation)",
        "",
    ]
    if figures:
        lines += ["| metric | value |", "| --- | --- |"]
        lines += [
            f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in figures.items()
        ]
    else:
        lines.append("None logged: run `rollmatch eval --model THIS_DIR --data val.jsonl`.")
    return "\n".join(lines) + "\n"


def usage_lines(settings: dict[str, Any] | None, *, coord: bool) -> list[str]:
    """How to prompt the model and turn its answer into pixel boxes."""
    if settings is None:
        return [
            f"This checkpoint holds no {RUN_FILE}: the prompt and coordinate frame it was trained with are "
            "unknown here; evaluate it with the run's config (`rollmatch eval --config`)."
        ]
    s = settings["settings"]
    uses_coord = s["custom.object_format"] == "coord_tokens"
    frame = (
        "`norm1000`: integers 0..1000 of the original image's width and height (x_pixel = x * W / 1000)"
        if s["data.coord_frame"] == "norm1000"
        else "`pixels`: pixels of the image as the processor resized it (min_pixels / max_pixels below); "
        "scale by original / resized size"
    )
    labels = s.get("data.labels")
    lines = [
        "## Prompt and answer",
        "",
        "One image, then this user prompt (Qwen-VL chat template)"
        + (", `{labels}` replaced by the class names joined with `, `" if labels else "")
        + ":",
        "",
        "```text",
        s["data.prompt"],
        "```",
        "",
        'Answer: one JSON list `[{"bbox_2d": [x1, y1, x2, y2], "label": "..."}, ...]`, then `<|im_end|>`.',
        f"- Coordinate frame {frame}.",
        f"- Image processor pixel bounds: min_pixels {s['data.min_pixels']}, max_pixels {s['data.max_pixels']} "
        "(saved in this folder's preprocessor config).",
    ]
    if uses_coord:
        lines.append(
            "- Each coordinate is one token `<|coord_k|>`, k in 0..999 (in the tokenizer): value in the "
            "norm1000 frame = round(k * 1000 / 999); decode with special tokens kept."
        )
    elif coord:
        lines.append("- The tokenizer has coordinate tokens, but this model writes coordinates as digits.")
    if labels:
        max_labels = s.get("data.prompt_max_labels")
        lines.append(
            f"- Class names ({len(labels)}): "
            + ", ".join(f"`{n}`" for n in labels[:50])
            + (" ..." if len(labels) > 50 else "")
        )
        if max_labels:
            lines.append(
                f"- Prompts list at most {max_labels} names: the image's own classes plus others drawn at random."
            )
    return lines


def _processor_source(src: Path, base_dir: str | None, processor_dir: str | Path | None) -> Path:
    if processor_dir is not None:
        return Path(processor_dir)
    if all((src / name).is_file() for name in TOKENIZER_FILES):
        return src
    if base_dir is not None:
        return Path(base_dir)
    raise _problem(
        "--processor",
        None,
        f"{src} holds no tokenizer: pass the model directory the run started from (or export its final/)",
    )


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _problem(key: str, value: Any, fix: str) -> ConfigError:
    return ConfigError([ConfigProblem(key, value, fix)])
