"""Dense shapes knobs: overlap bound, occlusion, same-class rows, distractors, zipf counts, the
crowd preset, the statistics written beside the data, and the default set's bytes pinned."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rollmatch.cli import main
from rollmatch.data.records import load_records
from rollmatch.data.shapes import (
    DISTRACTOR_CLASSES,
    SHAPE_CLASSES,
    SHAPES_PRESETS,
    STATS_FILE,
    ShapesDifficulty,
    SplitStats,
    _drawn_sample,
    generate_shapes,
    shape_sample,
)
from rollmatch.data.shapes_draw import _Placed, _resolve_occlusion, _shape_mask
from rollmatch.errors import DataError

COLOURS = {c.label: np.array(c.rgb, dtype=np.uint8) for c in SHAPE_CLASSES}
STUDY = ShapesDifficulty(min_objects=3, max_objects=5, min_side=44, max_side=80, tied_row_frac=1 / 3)


def _set_digests(out: Path) -> tuple[str, str]:
    """(sha256 of the PNG and JSONL file bytes, sha256 of the JSONL bytes and the decoded pixels)."""
    files, content = hashlib.sha256(), hashlib.sha256()
    for path in sorted(out.rglob("*")):
        if path.suffix not in (".png", ".jsonl"):
            continue
        files.update(path.relative_to(out).as_posix().encode())
        files.update(path.read_bytes())
        content.update(path.name.encode())
        content.update(
            path.read_bytes() if path.suffix == ".jsonl" else np.asarray(Image.open(path)).tobytes()
        )
    return files.hexdigest(), content.hexdigest()


# Computed with the generator as it was before the dense knobs existed. The file bytes also depend
# on the PNG encoder (Pillow 13.0.0, zlib 1.2.13); the content digest (JSONL + pixels) does not.
PINNED = {
    "default": (
        "397b34610a56f9fd5169e3fb50f9c2a76853f02d442ae45ce3a751c5c3a3b7c5",
        "740acfdd5fd97d5df66dba4b811f55908cfd1ae736d262b2830f8be70a486f78",
    ),
    "study": (
        "abad2ea6b8482e066e581f79c0bf01cf29c0b9b3e433ec2a00b8e1a2d2ad7f05",
        "bc006d4705acfc76589fac1adbce8754e5c0cf5f49560a2700509bb77d835ee8",
    ),
}


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [("default", {"seed": 0}), ("study", {"seed": 3, "difficulty": STUDY})],
)
def test_sets_without_the_new_knobs_keep_their_bytes(tmp_path: Path, name: str, kwargs: dict) -> None:
    generate_shapes(tmp_path, n_train=6, n_val=2, size=224, **kwargs)
    assert _set_digests(tmp_path) == PINNED[name]


def test_max_overlap_bounds_every_pair_of_boxes() -> None:
    def worst_overlap(difficulty: ShapesDifficulty) -> float:
        worst = 0.0
        for index in range(12):
            _, objects = shape_sample(index, seed=2, difficulty=difficulty, noise_std=0)
            boxes = [o.bbox for o in objects]
            for i, a in enumerate(boxes):
                for b in boxes[:i]:
                    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
                    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
                    smaller = min((a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1]))
                    worst = max(worst, ix * iy / smaller)
        return worst

    dense = replace(SHAPES_PRESETS["crowd"], min_objects=25, max_objects=30)
    assert worst_overlap(replace(dense, max_overlap=0.0)) == 0.0
    # boxes of circles and triangles overlap without their pixels touching (occlusion would shrink
    # the boxes to their visible parts, which the placement bound does not speak of)
    loose = worst_overlap(replace(dense, max_overlap=0.5))
    assert 0.2 < loose <= 0.5


def _square(x: int, y: int, side: int, label: str | None = "red square") -> _Placed:
    return _Placed(_shape_mask("square", side), x, y, (220, 30, 30), label)


def test_occlusion_keeps_the_visible_part_and_drops_what_is_hidden_too_much() -> None:
    # a 10 px square at (0, 0); a later 10 px square at (4, 0) hides its right 6 columns (60 %)
    bottom, top = _square(0, 0, 10), _square(4, 0, 10)
    kept, dropped = _resolve_occlusion([bottom, top], 32, occlusion=0.7)
    assert dropped == 0
    (_, bottom_visible), (_, top_visible) = kept
    assert bottom_visible.sum() == 40 and bottom_visible[:, :4].all() and not bottom_visible[:, 4:].any()
    assert top_visible.all()
    kept, dropped = _resolve_occlusion([bottom, top], 32, occlusion=0.5)
    assert dropped == 1 and [s for s, _ in kept] == [top]
    # dropping a shape uncovers the ones below it: c is hidden 60 % by b, which d then hides fully
    c, b, d = _square(0, 0, 10), _square(4, 0, 10), _square(4, 0, 10)
    kept, dropped = _resolve_occlusion([c, b, d], 32, occlusion=0.5)
    assert dropped == 2 and [s for s, _ in kept] == [d]
    # a distractor is never dropped, however hidden, yet it covers what lies under it
    hidden_distractor = _square(4, 0, 10, label=None)
    kept, dropped = _resolve_occlusion([c, hidden_distractor, _square(4, 0, 10)], 32, occlusion=0.5)
    assert dropped == 1 and kept[0][0] is hidden_distractor and not kept[0][1].any()
    assert _resolve_occlusion([bottom, top], 32, occlusion=None) == (
        [(bottom, bottom.mask), (top, top.mask)],
        0,
    )


def _touches(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return a[0] <= b[2] and b[0] <= a[2] and a[1] <= b[3] and b[1] <= a[3]


def test_occluded_boxes_are_the_visible_extent_and_hidden_shapes_are_dropped() -> None:
    """Noise-free renders: each box holds its colour on all four border lines and none just outside
    (boxes touching one of the same class are skipped). Many boxes are not square, while every whole
    shape spans a square (the same layouts without occlusion): occlusion really cut them; and some
    shapes were dropped."""
    difficulty = replace(SHAPES_PRESETS["crowd"], max_overlap=0.6, occlusion=0.5, distractors=3)
    checked = cut = 0
    stats = SplitStats()
    for index in range(8):
        drawn = _drawn_sample(index, "train", 224, 4, difficulty, 0.0)
        stats.add(drawn)
        padded = np.pad(np.asarray(drawn.image), ((1, 1), (1, 1), (0, 0)))
        for obj in drawn.objects:
            x1, y1, x2, y2 = (int(v) + 1 for v in obj.bbox)
            cut += int(x2 - x1 != y2 - y1)  # every whole shape of the set spans a square
            if any(
                o is not obj and o.label == obj.label and _touches(o.bbox, obj.bbox) for o in drawn.objects
            ):
                continue
            exact = (padded == COLOURS[obj.label]).all(axis=-1)
            own = exact[y1:y2, x1:x2]
            assert own[0].any() and own[-1].any() and own[:, 0].any() and own[:, -1].any(), obj
            assert not exact[y1 - 1, x1 - 1 : x2 + 1].any(), (obj, "above")
            assert not exact[y2, x1 - 1 : x2 + 1].any(), (obj, "below")
            assert not exact[y1 - 1 : y2 + 1, x1 - 1].any(), (obj, "left")
            assert not exact[y1 - 1 : y2 + 1, x2].any(), (obj, "right")
            checked += 1
    assert checked >= 60
    assert cut >= 10
    whole = replace(difficulty, occlusion=None)
    for index in range(8):
        _, objects = shape_sample(index, seed=4, difficulty=whole, noise_std=0)
        assert all(o.bbox[2] - o.bbox[0] == o.bbox[3] - o.bbox[1] for o in objects)
    assert stats.dropped_by_occlusion >= 1


def test_same_class_rows_are_tied_equal_and_a_few_px_apart() -> None:
    difficulty = replace(SHAPES_PRESETS["crowd"], same_class_row_frac=1.0)
    for index in range(10):
        _, objects = shape_sample(index, seed=5, difficulty=difficulty, noise_std=0)
        rows: dict[tuple[str, float, float], list[tuple[float, ...]]] = {}
        for obj in objects:  # same label, same top edge, same height
            rows.setdefault((obj.label, obj.bbox[1], obj.bbox[3]), []).append(obj.bbox)
        best = []
        for boxes in rows.values():
            boxes.sort()
            run = [boxes[0]]
            for box in boxes[1:]:
                gap = box[0] - run[-1][2]
                same_size = box[2] - box[0] == run[-1][2] - run[-1][0]
                run = [*run, box] if 2 <= gap <= 6 and same_size else [box]
                best = max(best, run, key=len)
            best = max(best, run, key=len)
        assert 4 <= len(best) <= 8, (index, objects)


def test_distractors_are_drawn_but_never_labelled() -> None:
    plain = ShapesDifficulty(min_objects=3, max_objects=5, noise_std=0)
    with_distractors = replace(plain, distractors=3)
    distractor_rgb = [np.array(c.rgb, dtype=np.uint8) for c in DISTRACTOR_CLASSES]
    seen = 0
    for index in range(6):
        image, objects = shape_sample(index, seed=1, difficulty=plain)
        image_d, objects_d = shape_sample(index, seed=1, difficulty=with_distractors)
        assert objects_d == objects  # placed after the labelled shapes, which they never cover
        pixels, pixels_d = np.asarray(image), np.asarray(image_d)
        assert not any((pixels == rgb).all(axis=-1).any() for rgb in distractor_rgb)
        seen += sum(int((pixels_d == rgb).all(axis=-1).any()) for rgb in distractor_rgb)
    assert seen >= 6
    assert not {c.label for c in DISTRACTOR_CLASSES} & set(COLOURS)


def test_zipf_counts_are_heavy_at_the_low_end() -> None:
    def counts(dist: str) -> np.ndarray:
        difficulty = ShapesDifficulty(min_objects=1, max_objects=12, min_side=8, max_side=10, count_dist=dist)  # type: ignore[arg-type]
        return np.array(
            [len(shape_sample(i, seed=0, difficulty=difficulty, noise_std=0)[1]) for i in range(150)]
        )

    uniform, zipf = counts("uniform"), counts("zipf")
    assert uniform.min() >= 1 and zipf.min() >= 1 and zipf.max() <= 12
    # P(1) = 1 / H_12 = 0.32 under zipf, 1 / 12 = 0.08 under uniform; means 3.9 vs 6.5
    assert (zipf == 1).mean() > 0.2 > (uniform == 1).mean()
    assert zipf.mean() < uniform.mean() - 1.5
    assert zipf.max() >= 9  # a tail, not a cut-off


def test_failed_placements_account_for_every_missing_shape(tmp_path: Path) -> None:
    packed = ShapesDifficulty(min_objects=30, max_objects=30, min_side=60, max_side=80, noise_std=0)
    stats: dict[str, SplitStats] = {}
    generate_shapes(tmp_path, n_train=5, n_val=0, size=224, seed=0, difficulty=packed, stats=stats)
    train = stats["train"]
    assert train.failed_placements > 0
    assert sum(train.objects_per_image) + train.failed_placements == 30 * 5
    written = json.loads((tmp_path / STATS_FILE).read_text())
    assert written["splits"]["train"] == train.summary()
    assert written["difficulty"]["min_objects"] == 30
    assert written["splits"]["train"]["objects_max"] == max(train.objects_per_image) < 30


def test_split_stats_summary_on_known_counts() -> None:
    stats = SplitStats(images=5, objects_per_image=[1, 2, 3, 4, 10], failed_placements=2)
    summary = stats.summary()
    assert summary["objects_mean"] == pytest.approx(4.0)
    assert (summary["objects_p10"], summary["objects_p50"], summary["objects_p90"]) == pytest.approx(
        (1.4, 3.0, 7.6)
    )
    assert summary["objects_max"] == 10 and summary["objects_min"] == 1 and summary["objects"] == 20
    assert "mean 4.0 (p10 1.4 / p50 3 / p90 7.6, max 10); failed placements 2" in stats.line("train")


def test_cli_crowd_preset_prints_and_writes_the_realised_statistics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "crowd"
    assert (
        main(["data", "shapes", "--out", str(out), "--preset", "crowd", "--train", "10", "--val", "2"]) == 0
    )
    printed = capsys.readouterr().out
    records = load_records(out / "train.jsonl")
    counts = [len(r.objects) for r in records]
    assert min(counts) >= 6 and max(counts) <= 30 and np.mean(counts) > 12  # 8-30 drawn, few placements fail
    sides = [min(o.bbox[2] - o.bbox[0], o.bbox[3] - o.bbox[1]) for r in records for o in r.objects]
    assert (
        min(sides) >= 14
        and max(max(o.bbox[2] - o.bbox[0], o.bbox[3] - o.bbox[1]) for r in records for o in r.objects) <= 32
    )
    stats = json.loads((out / STATS_FILE).read_text())
    assert stats["difficulty"] == {**stats["difficulty"], "min_objects": 8, "max_objects": 30, "min_side": 16}
    train = stats["splits"]["train"]
    assert train["objects"] == sum(counts)
    assert f"train: 10 images, objects/image mean {train['objects_mean']:.1f}" in printed
    assert f"failed placements {train['failed_placements']}" in printed
    assert "val: 2 images" in printed
    # a flag given beside a preset overrides that one setting
    assert main(["data", "shapes", "--out", str(out), "--preset", "crowd", "--train", "4", "--val", "0",
                 "--max-objects", "10", "--distractors", "2", "--count-dist", "zipf"]) == 0  # fmt: skip
    stats = json.loads((out / STATS_FILE).read_text())
    assert (stats["difficulty"]["max_objects"], stats["difficulty"]["min_side"]) == (10, 16)
    assert (stats["difficulty"]["distractors"], stats["difficulty"]["count_dist"]) == (2, "zipf")
    assert max(len(r.objects) for r in load_records(out / "train.jsonl")) <= 10


def test_cli_dense_flags_reach_the_generator(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "dense"
    argv = ["data", "shapes", "--out", str(out), "--train", "3", "--val", "0", "--preset", "crowd"]
    flags = ["--occlusion", "0.4", "--max-overlap", "0.5", "--same-class-rows", "1", "--tied-rows", "0"]
    assert main([*argv, *flags]) == 0
    stats = json.loads((out / STATS_FILE).read_text())
    assert stats["difficulty"] | {"occlusion": 0.4, "max_overlap": 0.5} == stats["difficulty"]
    assert stats["splits"]["train"]["same_class_rows"] == 3 and stats["splits"]["train"]["tied_rows"] == 0
    assert main([*argv, "--occlusion", "1.0"]) == 2
    assert "occlusion = 1.0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_overlap": 1.5}, "max_overlap = 1.5"),
        ({"occlusion": 1.0}, "occlusion = 1.0"),
        ({"same_class_row_frac": -0.1}, "same_class_row_frac = -0.1"),
        ({"distractors": -1}, "distractors = -1"),
        ({"count_dist": "poisson"}, "count_dist = 'poisson'"),
    ],
)
def test_bad_dense_knobs_are_data_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(DataError, match=message):
        ShapesDifficulty(**kwargs)
