"""A run is resolved once: building a rollout backend from it re-runs no config rule, resolves no
frame again and loads no second processor (measured by tracing the calls, on a real server)."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import rollmatch.config.frames as frames_module
import rollmatch.config.rules as rules_module
from rollmatch.collectives import LocalCollectives
from rollmatch.config.decoding import Decoding
from rollmatch.config.resolved import ResolvedRun, resolve_run
from rollmatch.config.schema import RollmatchConfig
from rollmatch.data.prompts import PromptEncoder, load_processor
from rollmatch.errors import ConfigError, ConfigProblem
from rollmatch.rollout.build import build_backend
from rollmatch.rollout.vllm_settings import vllm_installed

RULES = Path(rules_module.__file__).resolve()


@contextmanager
def traced_calls() -> Iterator[list[tuple[str, str, str]]]:
    """(callee file, callee function, caller file) of every Python call on this thread."""
    calls: list[tuple[str, str, str]] = []

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event == "call":
            caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
            calls.append((frame.f_code.co_filename, frame.f_code.co_name, caller))

    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(None)


def entries_into_rules(calls: list[tuple[str, str, str]]) -> list[tuple[str, str]]:
    """(caller module file name, rules function) of each call into config/rules.py from outside it."""
    return [
        (Path(caller).name, name)
        for callee, name, caller in calls
        if Path(callee).resolve() == RULES and Path(caller).resolve() != RULES
    ]


def calls_to(calls: list[tuple[str, str, str]], function: Callable[..., Any]) -> int:
    code = function.__code__
    return sum(1 for callee, name, _ in calls if callee == code.co_filename and name == code.co_name)


def test_a_server_backend_is_built_from_one_resolution(
    hf_server: Any,
    server_config: Callable[..., Any],
    loaded_tiny: tuple[Any, Any],
    free_port: Callable[[], int],
) -> None:
    """As ``training.entry`` builds it: resolve, load the processor, encoder, backend."""
    from transformers import AutoProcessor

    cfg = server_config(servers=[{"base_url": hf_server.url, "group_port": free_port()}])
    with traced_calls() as calls:
        run = resolve_run(cfg, world_size=1, device_count=0, device_type="cpu")
        processor = load_processor(run.model_dir, *run.pixel_bounds)
        encoder = PromptEncoder(processor, cfg.data.prompt, run.coord_frame)
        backend = build_backend(
            run,
            model=loaded_tiny[0],
            tokenizer=encoder.tokenizer,
            processor=encoder.processor,
            collectives=LocalCollectives(),
            eos_token_id=encoder.eos_token_id,
            pad_token_id=encoder.pad_token_id,
        )
    try:
        entries = entries_into_rules(calls)
        assert {caller for caller, _ in entries} == {"resolved.py"}, entries  # one place reaches the rules
        assert Counter(name for _, name in entries) == {"check_run": 1}  # every rule, static and runtime
        assert calls_to(calls, frames_module.resolve_coord_frame) == 1
        assert calls_to(calls, AutoProcessor.from_pretrained.__func__) == 1  # type: ignore[attr-defined]
        assert backend.sync_mode == run.sync_mode == "full"
        assert [c.url for c in backend.connections] == [hf_server.url]
    finally:
        backend.close()


@pytest.mark.skipif(not vllm_installed(), reason="the colocated backend needs vLLM")
def test_a_colocated_backend_reenters_no_rule() -> None:
    cfg = RollmatchConfig.model_validate(
        {
            "model": {"path": "m"},
            "data": {"coord_frame": "norm1000"},
            "custom": {"extra": {"rollout_matching": {"vllm": {"tensor_parallel_size": 1}}}},
        }
    )
    run = resolve_run(cfg, world_size=1, device_count=0, device_type="cpu")
    with traced_calls() as calls:
        backend = build_backend(
            run,
            model=None,
            tokenizer=None,
            processor=None,
            collectives=LocalCollectives(),
            eos_token_id=0,
            pad_token_id=0,
        )
    assert (
        entries_into_rules(calls) == []
    )  # before: config.rules entered from vllm_settings and vllm_colocate
    assert not backend.engine.started


def test_resolution_reports_runtime_and_caller_problems_at_once(tmp_path: Path) -> None:
    cfg = RollmatchConfig.model_validate(  # auto frame, no config.json; a colocated engine over 4 GPUs
        {
            "model": {"path": str(tmp_path)},
            "custom": {"extra": {"rollout_matching": {"vllm": {"tensor_parallel_size": 4}}}},
        }
    )
    with pytest.raises(ConfigError) as info:
        resolve_run(
            cfg,
            world_size=1,
            device_count=0,
            device_type="cpu",
            problems=[ConfigProblem("training.resume_from_checkpoint", "x", "checkpoint incomplete")],
        )
    keys = {p.key for p in info.value.problems}
    assert keys == {
        "training.resume_from_checkpoint",  # the caller's
        "custom.extra.rollout_matching.vllm.tensor_parallel_size",  # runtime: 4 on CPU
        "model.path",  # data.coord_frame: auto reads the family from the missing config.json
    }


def test_the_resolved_run_is_frozen(tiny_model_dir: Path) -> None:
    hf = {"custom": {"extra": {"rollout_matching": {"rollout_backend": "hf"}}}}
    cfg = RollmatchConfig.model_validate({"model": {"path": str(tiny_model_dir)}, **hf})
    run = resolve_run(cfg, world_size=2, device_count=0, device_type="cpu")
    assert isinstance(run, ResolvedRun)
    assert run.as_dict() == {
        "world_size": 2,
        "sync_mode": "full",
        "servers": [],
        "coord_frame": "pixels",  # the tiny model is a Qwen2.5-VL: auto resolves to its pixels frame
        "min_pixels": None,
        "max_pixels": None,
        "gradient_accumulation_steps": cfg.training.gradient_accumulation(2),
        "rollout_decode_batch_size": None,  # rollout_matching_sft: a micro-batch's records per call
        "decoding": asdict(Decoding()),  # the schema's rollout defaults: greedy, 512 new tokens
        "eval_decoding": asdict(Decoding()),  # eval.decoding greedy, the rollouts' budget
    }
    assert run.decoding == run.eval_decoding == Decoding(max_new_tokens=cfg.rollout.max_new_tokens)
    with pytest.raises(AttributeError):
        run.sync_mode = "adapter"  # type: ignore[misc]
