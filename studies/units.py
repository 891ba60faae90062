"""A study's units of work and the files they leave: each unit (a training run, an evaluation) runs
once, writes its JSON in the study folder, and a rerun reads it back instead of running it again.

Owns: :func:`cached` (a unit's JSON, written atomically), :func:`arm_runs` (an arm's finished seeds),
:func:`lock_settings` (a study folder refuses a rerun with other settings),
:func:`train_with_cost` (train or resume, logging each invocation's wall-clock and CPU seconds) and
:func:`training_cost`, :func:`evaluate` (``rollmatch eval``'s metrics with the per-image counts the
paired bootstrap needs), and the provenance every study records (:func:`git_commit`,
:func:`default_backend`, :func:`copy_processor` into a checkpoint).

Leaves out: what a unit trains (each driver's configs) and the statistics (``studies/study_statistics.py``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from rollmatch.config.schema import RollmatchConfig
from rollmatch.data.records import Record
from rollmatch.detection.matching import hungarian_match
from rollmatch.detection.metrics import duplicate_counts
from rollmatch.detection.objects import DetObject


def arm_runs(folder: Path, arm: str) -> dict[int, Any]:
    """The finished runs of ``arm`` in a study folder (``arms/<arm>/seed<N>.json``), by seed."""
    runs = {}
    for path in sorted((folder / "arms" / arm).glob("seed*.json")):
        runs[int(path.stem.removeprefix("seed"))] = json.loads(path.read_text())
    return runs


def cached(path: Path, compute: Any) -> Any:
    """``compute()`` once; its JSON is kept at ``path`` (written atomically) so a rerun resumes."""
    if path.exists():
        return json.loads(path.read_text())
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(value, indent=1))
    partial.replace(path)
    return value


def lock_settings(
    out: Path, args: argparse.Namespace, keys: tuple[str, ...], what: str = "study"
) -> dict[str, Any]:
    """``out/settings.json`` holds ``keys`` of the first run; a rerun with other values is refused."""
    settings = {key: getattr(args, key) for key in keys}
    path = out / "settings.json"
    saved = json.loads(path.read_text()) if path.exists() else settings
    differing = sorted(key for key in keys if saved.get(key) != settings[key])
    if differing:
        raise SystemExit(f"{out} holds a {what} with other {differing} ({path}); use another --out")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=1))
    return settings


def train_with_cost(cfg: RollmatchConfig, folder: Path, steps: int) -> tuple[float, float | None]:
    """Train ``cfg`` into ``folder`` unless its ``final/`` exists (resuming an interrupted run), logging
    each finished invocation's cost to ``folder/train_seconds.jsonl``; the :func:`training_cost` of
    ``steps`` steps."""
    from rollmatch.training.entry import run_training

    seconds_log = folder / "train_seconds.jsonl"  # one line per invocation that finished
    if not (folder / "final" / "config.json").exists():
        start_step, cpu_start = _resume_step(folder), time.process_time()
        result = run_training(cfg)
        line = {
            "seconds": result.seconds,
            "cpu_seconds": round(time.process_time() - cpu_start, 1),  # every thread of this process
            "global_step": result.global_step,
            "start_step": start_step,
        }
        with seconds_log.open("a") as f:
            f.write(json.dumps(line) + "\n")
    return training_cost([json.loads(line) for line in seconds_log.read_text().splitlines()], steps)


def training_cost(invocations: list[dict[str, Any]], steps: int) -> tuple[float, float | None]:
    """Wall-clock and CPU seconds of ``steps`` steps, from the finished invocations' cost per step (an
    interrupted invocation logs nothing; its steps are trained again by the next). CPU seconds only
    when every invocation measured them."""
    done = sum(line["global_step"] - line.get("start_step", 0) for line in invocations)
    wall = sum(line["seconds"] for line in invocations) / max(done, 1) * steps
    if not all("cpu_seconds" in line for line in invocations):
        return wall, None
    return wall, sum(line["cpu_seconds"] for line in invocations) / max(done, 1) * steps


def _resume_step(folder: Path) -> int:
    """The step training resumes from: the newest complete checkpoint's (0 for a fresh start)."""
    complete = [int(p.parent.name.split("-")[1]) for p in folder.glob("checkpoint-*/rollmatch_complete.json")]
    return max(complete, default=0)


def evaluate(
    cfg: RollmatchConfig, model_dir: str, records: list[Record], predictions: Path
) -> dict[str, Any]:
    """``rollmatch eval``'s metrics (study matching) plus per-image counts for the paired bootstrap."""
    from dataclasses import asdict

    from rollmatch.evaluation import run_eval

    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": model_dir})})
    result = asdict(run_eval(cfg, records, str(predictions)))
    result.pop("predictions_path")
    result["per_image"] = per_image_counts(records, predictions, cfg)
    return result


def per_image_counts(records: list[Record], predictions: Path, cfg: RollmatchConfig) -> dict[str, list[int]]:
    """TP / FP / FN / truncated per image, matched in pixels of the original image (eval.matching)."""
    counts: dict[str, list[int]] = {"tp": [], "fp": [], "fn": [], "truncated": [], "duplicates": []}
    answers = [json.loads(line) for line in predictions.read_text().splitlines()]
    for record, answer in zip(records, answers, strict=True):
        preds = [DetObject(o["label"], tuple(o["bbox"])) for o in answer["objects"]]
        gts = [DetObject(o.label, tuple(o.bbox)) for o in record.objects]
        match = hungarian_match(preds, gts, **cfg.eval.matching.model_dump())
        counts["tp"].append(len(match.pairs))
        counts["fp"].append(len(match.fp))
        counts["fn"].append(len(match.fn))
        counts["truncated"].append(int(answer["truncated"]))
        counts["duplicates"].append(duplicate_counts(preds)[0])
    return counts


PROCESSOR_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
)


def copy_processor(source: Path, checkpoint: Path) -> None:
    for name in PROCESSOR_FILES:
        if (source / name).exists() and not (checkpoint / name).exists():
            shutil.copy(source / name, checkpoint / name)


def default_backend() -> str:
    import importlib.util

    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
