"""A config shaped for users, the spec's spelling still valid: the top-level ``rollout:`` section, one
rollout decode batch for every variant, ``report_to`` as one name, colocate-only engine keys refused
in server mode naming where the server setting lives."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
from resolved_runs import resolve_for, resolved_config

from rollmatch.cli import main
from rollmatch.config.load import load_config, load_config_dict
from rollmatch.errors import ConfigError

SERVERS = {"servers": [{"base_url": "http://127.0.0.1:8000", "group_port": 51216}]}


def refused(data: dict[str, Any], overrides: tuple[str, ...] = ()) -> list[Any]:
    with pytest.raises(ConfigError) as info:
        resolved_config(data, overrides)
    return info.value.problems


def test_the_short_section_is_the_long_one() -> None:
    rollout = {"rollout_backend": "hf", "max_new_tokens": 64, "decoding": {"temperature": 0.5}}
    short = load_config_dict({"rollout": rollout})
    long = load_config_dict({"custom": {"extra": {"rollout_matching": rollout}}})
    assert short == long and short.rollout.max_new_tokens == 64
    assert load_config_dict({}, ["rollout.max_new_tokens=32"]).rollout.max_new_tokens == 32


def test_both_spellings_in_one_file_are_refused_naming_both(tmp_path: Path) -> None:
    path = tmp_path / "both.yaml"
    path.write_text(
        "rollout: {max_new_tokens: 64}\ncustom: {extra: {rollout_matching: {max_new_tokens: 32}}}\n",
        encoding="utf-8",
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    assert (
        problem.key == "rollout"
        and "custom.extra.rollout_matching" in problem.fix
        and str(path) in problem.fix
    )


def test_a_later_layer_may_use_the_other_spelling(tmp_path: Path) -> None:
    """Layers merge key by key: a file in the short form over a base in the long one sets the same keys."""
    base = tmp_path / "base.yaml"
    base.write_text("custom: {extra: {rollout_matching: {max_new_tokens: 32, rollout_backend: hf}}}\n")
    child = tmp_path / "child.yaml"
    child.write_text("extends: base.yaml\nrollout: {max_new_tokens: 64}\n")
    cfg = load_config(child, ["custom.extra.rollout_matching.decoding.temperature=0.5"])
    assert (cfg.rollout.max_new_tokens, cfg.rollout.rollout_backend, cfg.rollout.decoding.temperature) == (
        64,
        "hf",
        0.5,
    )


def test_messages_name_keys_as_the_user_wrote_them() -> None:
    (unknown,) = refused({"rollout": {"max_new_tokenz": 64}})
    assert unknown.key == "rollout.max_new_tokenz" and "did you mean rollout.max_new_tokens?" in unknown.fix
    (rule,) = refused({"rollout": {"vllm": {"max_model_len": 16}}})
    assert rule.key == "rollout.vllm.max_model_len"
    (server,) = refused({"rollout": {"vllm": {"mode": "server"}}})
    assert server.key == "rollout.vllm.server.servers" and "set rollout.vllm.server.servers:" in server.fix
    assert "custom.extra" not in server.fix
    (override,) = refused({"rollout": {"rollout_backend": "vllm"}}, ("rollout.vllm.max_model_len=16",))
    assert override.key == "rollout.vllm.max_model_len"
    assert "(set by override `rollout.vllm.max_model_len=16`)" in override.fix
    (spec,) = refused({"custom": {"extra": {"rollout_matching": {"vllm": {"max_model_len": 16}}}}})
    assert spec.key == "custom.extra.rollout_matching.vllm.max_model_len"  # the spec's spelling, as written


@pytest.mark.parametrize(
    ("key", "value", "fix"),
    [
        ("tensor_parallel_size", 2, "launch.tensor_parallel_size"),
        ("sleep_level", 1, "never sleeps"),
    ],
)
def test_a_colocate_only_key_in_server_mode_is_refused_naming_the_server_setting(
    key: str, value: int, fix: str
) -> None:
    (problem,) = refused({"rollout": {"vllm": {"mode": "server", "server": SERVERS, key: value}}})
    assert problem.key == f"rollout.vllm.{key}" and "no effect with rollout.vllm.mode: server" in problem.fix
    assert fix in problem.fix


def test_one_decode_batch_for_every_variant_in_the_resolved_run() -> None:
    stage2 = {
        "custom": {"trainer_variant": "stage2_ab_training"},
        "stage2_ab": {"schedule": {"b_ratio": 0.5}},
    }
    hf = {"rollout": {"rollout_backend": "hf"}}
    assert resolve_for(load_config_dict(hf)).rollout_decode_batch_size is None  # a micro-batch per call
    assert (
        resolve_for(load_config_dict({**hf, **stage2})).rollout_decode_batch_size == 2
    )  # Channel-B's default
    for variant in ({}, stage2):
        batch = {"rollout": {"rollout_backend": "hf", "decode_batch_size": 6}}
        assert resolve_for(load_config_dict({**batch, **variant})).rollout_decode_batch_size == 6


def test_the_channel_b_batch_key_is_read_as_the_decode_batch_with_a_warning() -> None:
    old = {"stage2_ab": {"channel_b": {"rollout_decode_batch_size": 4}}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config_dict(old)
    assert cfg.rollout.decode_batch_size == 4
    assert any("custom.extra.rollout_matching.decode_batch_size" in str(w.message) for w in caught)
    (both,) = refused({**old, "rollout": {"decode_batch_size": 2}})
    assert both.key == "stage2_ab.channel_b.rollout_decode_batch_size"
    assert "keep only `rollout.decode_batch_size`" in both.fix


@pytest.mark.parametrize(
    ("value", "expected"), [("wandb", ["wandb"]), ("none", []), (["tensorboard"], ["tensorboard"])]
)
def test_report_to_takes_one_name_as_hf_does(value: Any, expected: list[str]) -> None:
    assert load_config_dict({"training": {"report_to": value}}).training.report_to == expected


def test_check_config_prints_the_short_form_resolved_in_the_spec_spelling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "short.yaml"
    path.write_text("rollout: {rollout_backend: hf, decode_batch_size: 3}\n", encoding="utf-8")
    assert main(["check-config", "--schema-only", str(path), "--json"]) == 0
    import json

    printed = json.loads(capsys.readouterr().out)
    assert printed["custom"]["extra"]["rollout_matching"]["rollout_backend"] == "hf"
    assert printed["resolved"]["rollout_decode_batch_size"] == 3
