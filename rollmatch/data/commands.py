"""``rollmatch data shapes | convert | validate``: thin entry points over ``data.shapes``,
``data.convert`` and ``data.records`` (arguments are defined in ``rollmatch.cli``).

Owns: dispatch, the summary lines printed, exit codes (0 ok; 2 when ``validate`` finds problems;
:class:`~rollmatch.errors.DataError` is printed by the CLI and also exits 2). Leaves out every
rule about records and formats.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from rollmatch.data.convert import from_coco, from_voc, from_yolo, read_yolo_names
from rollmatch.data.convert_lvis import from_lvis, lvis_label
from rollmatch.data.convert_refexp import from_refexp
from rollmatch.data.labels import labels_file_for, write_label_file
from rollmatch.data.records import Record, validate_records, write_records
from rollmatch.data.shapes import SHAPES_PRESETS, STATS_FILE, ShapesDifficulty, SplitStats, generate_shapes
from rollmatch.errors import DataError


def data_command(args: argparse.Namespace) -> int:
    """Run one ``rollmatch data`` subcommand; returns the process exit code."""
    if args.data_command == "shapes":
        return _shapes(args)
    if args.data_command == "convert":
        return _convert(args)
    if args.data_command == "validate":
        return _validate(args)
    raise DataError(f"unknown data command {args.data_command!r}; use shapes, convert or validate")


def _shapes(args: argparse.Namespace) -> int:
    stats: dict[str, SplitStats] = {}
    paths = generate_shapes(
        args.out,
        n_train=args.train,
        n_val=args.val,
        size=args.size,
        seed=args.seed,
        difficulty=shapes_difficulty(args),
        stats=stats,
    )
    for split, path in paths.items():
        print(f"{split}: {path}")
    for split, split_stats in stats.items():
        print(split_stats.line(split))
    print(f"statistics: {Path(args.out).absolute() / STATS_FILE}")
    return 0


def shapes_difficulty(args: argparse.Namespace) -> ShapesDifficulty:
    """The preset's difficulty (or the default one) with every flag given on the command line applied."""
    base = SHAPES_PRESETS[args.preset] if args.preset else ShapesDifficulty()
    flags = {
        "min_objects": args.min_objects,
        "max_objects": args.max_objects,
        "min_side": args.min_side,
        "max_side": args.max_side,
        "noise_std": args.noise,
        "tied_row_frac": args.tied_rows,
        "max_overlap": args.max_overlap,
        "occlusion": args.occlusion,
        "same_class_row_frac": args.same_class_rows,
        "distractors": args.distractors,
        "count_dist": args.count_dist,
    }
    return replace(base, **{name: value for name, value in flags.items() if value is not None})


def _convert(args: argparse.Namespace) -> int:
    dropped: list[str] = []
    if args.format == "coco":
        if not args.images:
            raise DataError(
                "--images is required for --format coco: the folder COCO file_name is relative to"
            )
        records = from_coco(args.src, args.images, dropped=dropped)
    elif args.format == "lvis":
        records = _convert_lvis(args, dropped)
    elif args.format == "refexp":
        if not args.images or not args.instances:
            raise DataError("--images and --instances are required for --format refexp (see docs/data.md)")
        records = from_refexp(args.src, args.instances, args.images, split=args.split)
    elif args.format == "voc":
        records = from_voc(args.src, dropped=dropped)
    else:
        if not args.names:
            raise DataError("--names is required for --format yolo: the dataset's data.yaml with class names")
        records = from_yolo(args.src, read_yolo_names(args.names), dropped=dropped)
    # Converted records keep absolute image paths: the images stay where the source dataset is.
    path = write_records(args.out, records)
    print(f"wrote {path}: {describe_records(records)}")
    names = class_names(args, records)
    if names is not None:
        labels = write_label_file(labels_file_for(args.out), names)
        print(
            f"wrote {labels}: {len(names)} class names ({{labels}} in data.prompt lists them; docs/data.md)"
        )
    for note in dropped:
        print(note)
    if dropped:
        print(f"dropped {len(dropped)} zero-area box(es) listed above (they cannot be learned or serialized)")
    return 0


def class_names(args: argparse.Namespace, records: Sequence[Record]) -> list[str] | None:
    """The dataset's class names: COCO / LVIS (ODinW is COCO-shaped) ``categories`` in id order, whether
    or not this file has boxes of them; YOLO ``data.yaml``'s; VOC the labels its records use, sorted.
    None for referring expressions (each record's own prompt names its object)."""
    if args.format in ("coco", "lvis"):
        data = json.loads(Path(args.src).read_text(encoding="utf-8"))
        categories = sorted(data["categories"], key=lambda c: c["id"])
        rename = lvis_label if args.format == "lvis" else str.strip
        return list(dict.fromkeys(rename(str(c["name"])) for c in categories))
    if args.format == "yolo":
        return read_yolo_names(args.names)
    if args.format == "voc":
        return sorted({obj.label for record in records for obj in record.objects})
    return None


def _convert_lvis(args: argparse.Namespace, dropped: list[str]) -> list[Record]:
    if not args.images:
        raise DataError(
            "--images is required for --format lvis: the folder holding COCO's train2017/ and val2017/"
        )
    stats: dict[str, int] = {}
    records = from_lvis(args.src, args.images, dropped=dropped, stats=stats)
    if stats["not_exhaustive_images"]:
        print(
            f"{stats['not_exhaustive_images']} image(s) have not-exhaustively annotated categories "
            f"({stats['not_exhaustive_boxes']} box(es) of them): predictions of those count as false positives"
        )
    return records


def _validate(args: argparse.Namespace) -> int:
    problems = validate_records(args.file)
    for problem in problems:
        print(problem)
    if problems:
        print(f"{args.file}: {len(problems)} problem(s)")
        return 2
    print(f"{args.file}: ok")
    return 0


def describe_records(records: Sequence[Record]) -> str:
    """One line: images, boxes and boxes per label, e.g. ``200 images, 217 boxes; raccoon 217``."""
    per_label = Counter(o.label for r in records for o in r.objects)
    labels = ", ".join(f"{label} {n}" for label, n in sorted(per_label.items()))
    crowds = sum(len(r.ignore) for r in records)
    kept = (
        f"; {crowds} crowd regions kept as ignore regions in {sum(1 for r in records if r.ignore)} images"
        if crowds
        else ""
    )
    return f"{len(records)} images, {sum(per_label.values())} boxes; {labels or 'no labels'}{kept}"
