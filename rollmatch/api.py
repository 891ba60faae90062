"""The short public Python API (documented in docs/api.md).

Everything here is stable to import from ``rollmatch.api``; module paths behind it may move.
"""

from rollmatch.config.load import load_config, load_config_dict
from rollmatch.config.resolved import ResolvedRun, resolve_run, resolve_run_on_this_machine
from rollmatch.config.schema import RollmatchConfig
from rollmatch.data.prompts import EncodedPrompt, PromptEncoder, load_processor
from rollmatch.data.records import Record, RecordObject, load_records
from rollmatch.detection.codec import ObjectCodec, ParseResult, QwenJsonCodec
from rollmatch.detection.matching import MatchResult, hungarian_match
from rollmatch.detection.object_formats import build_codec
from rollmatch.detection.objects import DetObject, iou
from rollmatch.detection.scoring import ScoreCounts, ScoredResponse, score_response
from rollmatch.detection.targets import (
    TargetSequence,
    build_gt_target,
    build_matched_target,
    build_rollout_target,
)
from rollmatch.evaluation import EvalResult, evaluate, run_eval
from rollmatch.rollout.build import build_backend
from rollmatch.rollout.hf import HFBackend
from rollmatch.rollout.types import Decoding, Rollout, RolloutBackend, RolloutRequest
from rollmatch.training.entry import run_training

__all__ = [
    "Decoding",
    "DetObject",
    "EncodedPrompt",
    "EvalResult",
    "HFBackend",
    "MatchResult",
    "ObjectCodec",
    "ParseResult",
    "PromptEncoder",
    "QwenJsonCodec",
    "Record",
    "RecordObject",
    "ResolvedRun",
    "RollmatchConfig",
    "Rollout",
    "RolloutBackend",
    "RolloutRequest",
    "ScoreCounts",
    "ScoredResponse",
    "TargetSequence",
    "build_backend",
    "build_codec",
    "build_gt_target",
    "build_matched_target",
    "build_rollout_target",
    "evaluate",
    "hungarian_match",
    "iou",
    "load_config",
    "load_config_dict",
    "load_processor",
    "load_records",
    "resolve_run",
    "resolve_run_on_this_machine",
    "run_eval",
    "run_training",
    "score_response",
]
