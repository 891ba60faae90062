"""``rollmatch export --checkpoint DIR --out DIR``: a training checkpoint as a standalone model folder.

Owns: :func:`export_checkpoint`. The folder holds the merged weights (LoRA / DoRA adapters merged
into the base with PEFT's ``merge_and_unload``, in float32), the processor and tokenizer (with the coordinate
tokens when the checkpoint has them) and its chat template, and a ``README.md`` model card with the
checkpoint's evaluation figures (the last ``eval/*`` entry of its ``trainer_state.json``). It loads
with ``from_pretrained`` and serves with ``vllm serve`` / ``rollmatch serve``.

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
    if adapter_config:
        from peft import PeftModel

        base = AutoModelForImageTextToText.from_pretrained(base_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, str(src)).merge_and_unload()
    elif (src / "config.json").is_file():
        model = AutoModelForImageTextToText.from_pretrained(src, dtype="auto")
    else:
        raise _problem(
            "--checkpoint", str(src), "has neither config.json (full weights) nor adapter_config.json"
        )
    processor = AutoProcessor.from_pretrained(str(_processor_source(src, base_dir, processor_dir)))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    (out / "README.md").write_text(model_card(src, adapter_config is not None, processor), encoding="utf-8")
    return out


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


def model_card(checkpoint: Path, merged_lora: bool, processor: Any) -> str:
    """The README of an exported folder: provenance, how to load it, the evaluation figures."""
    figures = last_eval_figures(checkpoint)
    vocab = processor.tokenizer.get_vocab()
    coord = "<|coord_0|>" in vocab
    lines = [
        "# Detection model trained with rollmatch",
        "",
        f"Exported from `{checkpoint.resolve()}`"
        + (" (LoRA adapters merged into the base weights)." if merged_lora else "."),
        'Answers a detection prompt with a JSON list of `{"bbox_2d": [x1, y1, x2, y2], "label": ...}`'
        + (" written with coordinate tokens." if coord else "."),
        "",
        "```bash",
        "vllm serve THIS_DIR            # or: rollmatch serve --model THIS_DIR; rollmatch eval --model THIS_DIR",
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
