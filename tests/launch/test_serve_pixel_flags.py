"""`rollmatch serve --min-pixels/--max-pixels`: the server's processor resizes like the trainer's, so the
start-up fingerprint check passes with `data.min_pixels`/`data.max_pixels` set (and fails without)."""

from __future__ import annotations

from pathlib import Path

from rollmatch.cli import build_parser
from rollmatch.config.resolved import resolve_run_on_this_machine
from rollmatch.config.schema import RollmatchConfig
from rollmatch.data.prompts import load_processor
from rollmatch.rollout.server_compat import local_model_info
from rollmatch.server.engines import build_engine


def test_pixel_flags_give_the_trainers_processor_fingerprint(tiny_model_dir: Path) -> None:
    cfg = RollmatchConfig.model_validate(
        {
            "model": {"path": str(tiny_model_dir)},
            "data": {"min_pixels": 3136, "max_pixels": 6272},
            "custom": {"extra": {"rollout_matching": {"rollout_backend": "hf"}}},
        }
    )
    run = resolve_run_on_this_machine(cfg)
    trainer = local_model_info(run, None, load_processor(run.model_dir, *run.pixel_bounds)).fingerprint
    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            str(tiny_model_dir),
            "--engine",
            "hf",
            "--min-pixels",
            "3136",
            "--max-pixels",
            "6272",
        ]
    )
    engine = build_engine(
        args.engine,
        args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        min_pixels=args.min_pixels,
        max_pixels=args.max_pixels,
    )
    assert engine.fingerprint == trainer
    assert engine.preparer.processor.image_processor.size == {"shortest_edge": 3136, "longest_edge": 6272}
    unpinned = build_engine("hf", str(tiny_model_dir), dtype="float32", max_model_len=1024)
    assert unpinned.fingerprint["processor"] != trainer["processor"]  # what a launch without the flags hit
