"""What can be checked about a run's inputs without a GPU, shared by ``check-config``, ``train`` and ``launch``.

Owns: :func:`run_input_problems` (the input files of ``config.input_files``, then, when they are
there, the length of every training record against ``training.global_max_length``) and the
``rollmatch check-config`` command, which adds these checks to the config's own
(``config.load.check_config_command``; ``--schema-only`` skips them, e.g. on a laptop without the
data). ``train`` runs the same function before the model loads and ``launch`` before any server
starts, so a config ``check-config`` refuses is refused by them with the same message.

Leaves out: the rules on keys and values (``config.rules``) and anything that needs the model's
weights or a device (``config.resolved.resolve_run``).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from rollmatch.config.frames import resolve_coord_frame
from rollmatch.config.input_files import input_file_problems
from rollmatch.config.load import check_config_command as check_config_keys
from rollmatch.config.schema import RollmatchConfig
from rollmatch.errors import ConfigError, ConfigProblem, DataError

if TYPE_CHECKING:
    from rollmatch.data.prompts import PromptEncoder
    from rollmatch.data.record_lengths import LengthScan


def check_config_command(args: argparse.Namespace) -> int:
    """``rollmatch check-config FILE [overrides...] [--json] [--schema-only]`` (see the module docstring)."""
    if getattr(args, "schema_only", False):
        return check_config_keys(args)
    return check_config_keys(args, input_checks=_report_inputs)


def run_input_problems(cfg: RollmatchConfig) -> tuple[list[ConfigProblem], LengthScan | None]:
    """Every input problem of ``cfg``, and the length scan when the files were there to run it.

    The scan's over-long records are a problem under ``data.over_length: error``; under ``drop``
    they are only reported (``train`` leaves them out).
    """
    problems = input_file_problems(cfg)
    if problems:
        return problems, None
    # torch, PIL and transformers only once there is something to scan (`--help` and bad keys stay fast)
    from rollmatch.data.record_lengths import scan_lengths
    from rollmatch.data.records import load_records
    from rollmatch.detection.object_formats import build_codec

    try:
        encoder = input_encoder(cfg)
        codec = build_codec(cfg.custom.object_format, encoder.tokenizer, [encoder.eos_token_id])
        records = load_records(cfg.data.train_jsonl, max_samples=cfg.data.max_samples)
    except ConfigError as error:
        return error.problems, None
    except DataError as error:
        return [ConfigProblem("data.train_jsonl", cfg.data.train_jsonl, str(error))], None
    scan = scan_lengths(cfg, records, encoder, codec)
    if scan.over and (cfg.data.over_length == "error" or len(scan.over) == scan.total):
        problems.append(scan.problem())
    return problems, scan


def raise_on_input_problems(cfg: RollmatchConfig) -> None:
    """:func:`run_input_problems` as one :class:`ConfigError` (``launch``, before any server starts)."""
    problems, _ = run_input_problems(cfg)
    if problems:
        raise ConfigError(problems)


def input_encoder(cfg: RollmatchConfig) -> PromptEncoder:
    """The prompt encoder of the run: the model directory's processor, pixel bounds and frame."""
    from rollmatch.data.labels import prompt_labels
    from rollmatch.data.prompts import PromptEncoder, load_processor

    frame = resolve_coord_frame(cfg.data.coord_frame, cfg.model.path, object_format=cfg.custom.object_format)
    processor = load_processor(cfg.model.path, cfg.data.min_pixels, cfg.data.max_pixels)
    return PromptEncoder(processor, cfg.data.prompt, frame, prompt_labels(cfg.data, cfg.training.seed))


def _report_inputs(cfg: RollmatchConfig) -> list[ConfigProblem]:
    problems, scan = run_input_problems(cfg)
    if scan is not None and not problems:
        if scan.over:
            print(f"inputs: data.over_length: drop leaves out {scan.summary()}", file=sys.stderr)
        else:
            print(f"inputs: all {scan.total} training records fit {scan.limit} tokens", file=sys.stderr)
    return problems
