"""Two learning-signal studies that differ only in ``--object-format``, compared on the same images.

``studies/learning_signal.py`` answers "does an arm beat more SFT?" inside one study. Whether coordinate
tokens beat digits is a question across two studies: the same data (generated from the same seeds),
stage-1 steps, arms, seeds and learning rates, another object format. This script pairs them:

- **stage-1**: both studies' stage-1 checkpoints on the dev split (the gate's evaluation; equal steps);
- **each arm** present in both, at every decision step, on the report split, seed by seed (the same
  records and seed on both sides).

Statistics are the study's: paired bootstrap over seeds x images of label-aware F1@0.5 (study minus
baseline), with the differences in mAP and mean matched IoU. Prints ONE JSON object; ``--docs`` writes it
to docs/learning_signal_<format>_vs_<format>.json. Run (after both studies, or any time for the units
done so far)::

    .venv/bin/python -m studies.compare_studies --study runs/ls_coord --baseline runs/ls_9k --docs

**Replication over stage-1 seeds**: give one study per ``--stage1-seed`` on each side; they are paired
by stage-1 seed, the bootstrap resamples stage-1 seeds (for ``stage1_dev``) or (stage-1 seed, arm seed)
pairs (for the arms) together with the images, and ``stage1_dev.t_test_over_stage1_seeds`` is the
seed-level interval (a t interval over one paired difference per stage-1 seed: wide with two)::

    .venv/bin/python -m studies.compare_studies --study runs/ls_coord runs/ls_coord_s1 \
        --baseline runs/ls_9k runs/ls_9k_s1 --docs
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from studies.study_statistics import paired_bootstrap, paired_t
from studies.units import arm_runs

# Settings that may differ between the two studies; everything else must be equal.
FREE_SETTINGS = ("object_format", "arms", "seeds", "backend", "bootstrap")
METRICS = ("f1", "map", "mean_iou", "duplicate_rate", "fp_per_image", "truncated_frac")
# Smallest setting (tests/studies/test_study_smoke.py runs it; docs/runbook.md "Benchmarks").
# A study compared with itself: the smallest learning_signal.py study, run first (SMOKE_AFTER).
SMOKE_AFTER = ("learning_signal",)
SMOKE_ARGS = "--study {tmp}/learning_signal --baseline {tmp}/learning_signal --bootstrap 10"
SMOKE_KEYS = ("study", "baseline", "stage1_dev", "arms")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m studies.compare_studies",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--study", required=True, nargs="+", help="learning_signal.py --out folders, one per --stage1-seed"
    )
    parser.add_argument(
        "--baseline", required=True, nargs="+", help="the same studies with another --object-format"
    )
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    parser.add_argument("--docs", action="store_true", help="write the JSON into docs/")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    result = compare_studies([Path(p) for p in args.study], [Path(p) for p in args.baseline], args.bootstrap)
    text = json.dumps(result, indent=1)
    print(text)
    if args.docs:
        name = f"learning_signal_{result['study']['object_format']}_vs_{result['baseline']['object_format']}"
        (Path(__file__).parents[1] / "docs" / f"{name}.json").write_text(text + "\n")


def compare_studies(study: Path | list[Path], baseline: Path | list[Path], resamples: int) -> dict[str, Any]:
    """Study minus baseline, paired by stage-1 seed (``--stage1-seed``, 0 when a study predates it): with
    one study per side, that study's stage-1 and arms; with several, the resampled "seeds" are every
    (stage-1 seed, arm seed) pair, and the stage-1 difference also gets a t-test over stage-1 seeds."""
    sides = {"study": _by_stage1_seed(study), "baseline": _by_stage1_seed(baseline)}
    if set(sides["study"]) != set(sides["baseline"]):
        raise SystemExit(
            f"the studies have stage-1 seeds {sorted(sides['study'])}, the baselines "
            f"{sorted(sides['baseline'])}: give one study per stage-1 seed on each side"
        )
    stage1_seeds = sorted(sides["study"])
    for seed in stage1_seeds:
        _check_same_design(sides["study"][seed], sides["baseline"][seed])
    settings = {name: _settings(sides[name][stage1_seeds[0]]) for name in sides}
    rng = np.random.default_rng(0)
    result: dict[str, Any] = {
        name: {
            "folder": str(sides[name][stage1_seeds[0]]),
            "folders": [str(sides[name][s]) for s in stage1_seeds],
            "object_format": settings[name]["object_format"],
        }
        for name in sides
    }
    result["stage1_seeds"] = stage1_seeds
    gates = {name: [_read(sides[name][s] / "gate.json") for s in stage1_seeds] for name in sides}
    if all(all(g) for g in gates.values()):
        result["stage1_dev"] = contrast(
            [g["dev"] for g in gates["study"]], [g["dev"] for g in gates["baseline"]], resamples, rng
        )
        if len(stage1_seeds) > 1:  # the seed-level interval: one paired difference per stage-1 seed
            result["stage1_dev"]["t_test_over_stage1_seeds"] = paired_t(result["stage1_dev"]["per_seed"])
    result["arms"] = {}
    arms = set(settings["study"]["arms"]) & set(settings["baseline"]["arms"])
    for arm in sorted(arms):
        runs = {name: [arm_runs(sides[name][s], arm) for s in stage1_seeds] for name in sides}
        seeds = sorted(set.intersection(*(set(r) for side in runs.values() for r in side)))
        if not seeds:
            continue
        result["arms"][arm] = {"seeds": seeds}
        for step in map(str, settings["study"]["decide_at"]):
            paired = [
                [run[seed]["evals"][step]["report"] for run in runs[name] for seed in seeds] for name in sides
            ]
            result["arms"][arm][step] = contrast(*paired, resamples, rng)
    return result


def _by_stage1_seed(folders: Path | list[Path]) -> dict[int, Path]:
    by_seed: dict[int, Path] = {}
    for folder in [folders] if isinstance(folders, Path) else folders:
        seed = _settings(folder).get("stage1_seed", 0)
        if seed in by_seed:
            raise SystemExit(f"{by_seed[seed]} and {folder} both have stage-1 seed {seed}")
        by_seed[seed] = folder
    return by_seed


def _check_same_design(study: Path, baseline: Path) -> None:
    settings = {"study": _settings(study), "baseline": _settings(baseline)}
    differing = sorted(
        key
        for key in set(settings["study"]) | set(settings["baseline"])
        if key not in FREE_SETTINGS and settings["study"].get(key) != settings["baseline"].get(key)
    )
    if differing:
        raise SystemExit(
            f"{study} and {baseline} differ in {differing}: they do not see the same data and schedule "
            "(run the study again with the baseline's settings and another --out)"
        )


def contrast(
    study: list[dict[str, Any]], baseline: list[dict[str, Any]], resamples: int, rng: np.random.Generator
) -> dict[str, Any]:
    """Study minus baseline: bootstrap of F1 over seeds x images, means of the other metrics."""
    images = {len(e["per_image"]["tp"]) for e in study + baseline}
    if len(images) != 1:
        raise SystemExit(f"the two studies evaluated different image counts {sorted(images)}: not paired")
    result = paired_bootstrap(
        [e["per_image"] for e in study], [e["per_image"] for e in baseline], resamples, rng
    )
    for metric in METRICS:
        ours, theirs = (float(np.mean([e[metric] for e in side])) for side in (study, baseline))
        result[metric] = {
            "study": round(ours, 4),
            "baseline": round(theirs, 4),
            "delta": round(ours - theirs, 4),
        }
    return result


def _settings(folder: Path) -> dict[str, Any]:
    settings = _read(folder / "settings.json")
    if settings is None:
        raise SystemExit(f"{folder} is not a learning_signal.py study (no settings.json)")
    return settings


def _read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


if __name__ == "__main__":
    main()
