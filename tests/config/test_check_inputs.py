"""``check-config`` checks a run's inputs (files, hub ids, record lengths) and ``train`` refuses the same
configs with the same message, before the model loads."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from rollmatch.cli import main
from rollmatch.config.load import load_config
from rollmatch.data.input_checks import input_encoder
from rollmatch.data.record_lengths import record_lengths
from rollmatch.data.records import load_records
from rollmatch.data.shapes import ShapesDifficulty, generate_shapes
from rollmatch.detection.object_formats import build_codec
from rollmatch.detection.targets import build_gt_target


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    # 1-6 objects per image at two sizes: target lengths differ from record to record
    return generate_shapes(tmp_path_factory.mktemp("inputs_shapes"), n_train=12, n_val=2, size=112, seed=3)


def _config(model: Path | str, train: Path | str, **training: Any) -> dict[str, Any]:
    return {
        "model": {"path": str(model)},
        "data": {"train_jsonl": str(train), "val_jsonl": None, "coord_frame": "norm1000"},
        "custom": {"trainer_variant": "sft"},
        "training": {"output_dir": "out", "report_to": [], "max_steps": 1, **training},
    }


def _problem_lines(err: str) -> list[str]:
    """``key = value: fix`` per problem, from check-config's two-line form or the CLI's one-line form."""
    joined = re.sub(r"\n\s+fix: ", ": ", err)
    return [line.strip()[2:] for line in joined.splitlines() if line.strip().startswith("- ")]


def test_each_missing_file_is_named_with_exit_2(write_yaml, tmp_path: Path, capsys) -> None:
    cfg = _config(tmp_path / "no_model", "records/train.jsonl")
    cfg["data"]["val_jsonl"] = "records/val.jsonl"
    cfg["training"]["eval_steps"] = 5  # in-training evaluation reads the validation records
    path = write_yaml("run/c.yaml", cfg)
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "(3 problem(s))" in err
    assert f"- model.path = '{tmp_path / 'no_model'}'" in err and "directory not found" in err
    # relative to the config file's folder, not the working directory
    assert f"file not found: {tmp_path / 'run' / 'records' / 'train.jsonl'}" in err
    assert f"file not found: {tmp_path / 'run' / 'records' / 'val.jsonl'}" in err


def test_a_hub_id_is_told_to_download_first(write_yaml, shapes: dict[str, Path], capsys) -> None:
    path = write_yaml("c.yaml", _config("Qwen/Qwen2.5-VL-3B-Instruct", shapes["train"]))
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "(1 problem(s))" in err and "- model.path = 'Qwen/Qwen2.5-VL-3B-Instruct'" in err
    assert "Download it first (e.g. `huggingface-cli download Qwen/Qwen2.5-VL-3B-Instruct" in err
    assert "set model.path to the local directory" in err


def test_a_directory_without_config_json_is_not_a_model(write_yaml, tmp_path, shapes, capsys) -> None:
    (tmp_path / "empty").mkdir()
    path = write_yaml("c.yaml", _config(tmp_path / "empty", shapes["train"]))
    assert main(["check-config", str(path)]) == 2
    assert "holds no config.json" in capsys.readouterr().err


def test_input_paths_resolve_against_the_config_file(
    tmp_path: Path, tiny_model_dir: Path, shapes: dict[str, Path], monkeypatch, capsys
) -> None:
    folder = tmp_path / "configs" / "runs"
    folder.mkdir(parents=True)
    (folder / "ds.json").write_text('{"zero_optimization": {"stage": 2}}', encoding="utf-8")
    (tmp_path / "configs" / "base.yaml").write_text(
        yaml.safe_dump(
            _config(
                os.path.relpath(tiny_model_dir, tmp_path / "configs"),
                os.path.relpath(shapes["train"], tmp_path / "configs"),
            )
        ),
        encoding="utf-8",
    )
    # The extending file sets the DeepSpeed JSON relative to itself; the base's paths stay relative to the base.
    (folder / "run.yaml").write_text(
        yaml.safe_dump({"extends": "../base.yaml", "training": {"deepspeed": "ds.json"}}), encoding="utf-8"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["check-config", str(folder / "run.yaml")]) == 0, capsys.readouterr().err
    cfg = load_config(folder / "run.yaml")
    assert Path(cfg.model.path) == tiny_model_dir.resolve()
    assert Path(cfg.data.train_jsonl) == shapes["train"].resolve()
    assert cfg.training.deepspeed == str(folder / "ds.json")
    assert cfg.training.output_dir == "out"  # outputs stay relative to the working directory
    # an override's relative path is the working directory's
    assert load_config(folder / "run.yaml", ["data.train_jsonl=x.jsonl"]).data.train_jsonl == "x.jsonl"


def test_record_lengths_equal_the_encoded_prompt_and_target(tiny_model_dir: Path, shapes) -> None:
    for frame in ("norm1000", "pixels"):
        cfg = load_config(
            None,
            [
                f"model.path={tiny_model_dir}",
                f"data.train_jsonl={shapes['train']}",
                f"data.coord_frame={frame}",
                "data.max_pixels=6272",
            ],
        )
        encoder = input_encoder(cfg)
        codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
        records = load_records(shapes["train"])
        for record, length in zip(records, record_lengths(records, encoder, codec), strict=True):
            encoded = encoder.encode(record)
            target = build_gt_target(
                encoder.gt_objects(record, encoded),
                codec=codec,
                tokenizer=encoder.tokenizer,
                eos_token_id=encoder.eos_token_id,
            )
            assert (length.prompt_tokens, length.target_tokens) == (
                len(encoded.input_ids),
                len(target.token_ids),
            )


@pytest.fixture(scope="module")
def crowded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Records with 1 to 8 objects: a row budget between their lengths splits them."""
    difficulty = ShapesDifficulty(min_objects=1, max_objects=8)
    folder = tmp_path_factory.mktemp("crowded")
    return generate_shapes(folder, n_train=10, n_val=0, size=112, seed=1, difficulty=difficulty)["train"]


def _budget_between(tiny_model_dir: Path, train: Path) -> tuple[int, int]:
    """A global_max_length some records exceed, and how many do."""
    cfg = load_config(
        None, [f"model.path={tiny_model_dir}", f"data.train_jsonl={train}", "data.coord_frame=norm1000"]
    )
    encoder = input_encoder(cfg)
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    needed = sorted(
        r.prompt_tokens + r.target_tokens for r in record_lengths(load_records(train), encoder, codec)
    )
    assert needed[0] < needed[-1], needed
    limit = needed[len(needed) // 2]
    return limit, sum(1 for n in needed if n > limit)


def test_over_long_records_are_counted_named_and_dropped_on_request(
    write_yaml, tiny_model_dir: Path, crowded: Path, capsys
) -> None:
    limit, over = _budget_between(tiny_model_dir, crowded)
    path = write_yaml("c.yaml", _config(tiny_model_dir, crowded, global_max_length=limit))
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"- training.global_max_length = {limit}" in err
    assert f"{over} of 10 training records need more than {limit} tokens" in err
    assert "set data.over_length: drop" in err
    assert main(["check-config", str(path), "data.over_length=drop"]) == 0
    assert f"inputs: data.over_length: drop leaves out {over} of 10" in capsys.readouterr().err


def test_train_refuses_what_check_config_refuses_before_loading_the_model(
    write_yaml, tmp_path: Path, tiny_model_dir: Path, crowded: Path, capsys, monkeypatch
) -> None:
    def no_model_load(cfg: Any) -> Any:
        raise AssertionError("the model loaded before the inputs were checked")

    monkeypatch.setattr("rollmatch.training.entry.load_model", no_model_load)
    monkeypatch.chdir(tmp_path)
    limit, _ = _budget_between(tiny_model_dir, crowded)
    cases = {
        "missing.yaml": _config(tmp_path / "no_model", "nowhere.jsonl"),
        "hub.yaml": _config("Qwen/Qwen3-VL-4B-Instruct", crowded),
        "long.yaml": _config(tiny_model_dir, crowded, global_max_length=limit),
    }
    for name, cfg in cases.items():
        path = write_yaml(name, cfg)
        assert main(["check-config", str(path)]) == 2
        checked = _problem_lines(capsys.readouterr().err)
        assert main(["train", str(path)]) == 2
        trained = _problem_lines(capsys.readouterr().err)
        assert checked and trained == checked, name


def test_launch_refuses_missing_inputs_before_any_server_starts(write_yaml, tmp_path: Path, capsys) -> None:
    cfg = _config(tmp_path / "no_model", tmp_path / "nowhere.jsonl")
    cfg["custom"] = {
        "trainer_variant": "rollout_matching_sft",
        "extra": {"rollout_matching": {"vllm": {"mode": "server", "tensor_parallel_size": 1}}},
    }
    cfg["training"]["output_dir"] = str(tmp_path / "out")
    path = write_yaml("launch.yaml", cfg)
    servers = (
        "custom.extra.rollout_matching.vllm.server.servers=[{base_url: 'http://127.0.0.1:1', group_port: 2}]"
    )
    assert main(["check-config", str(path), servers]) == 2  # launch writes the server list itself
    checked = _problem_lines(capsys.readouterr().err)
    assert main(["launch", str(path), "--cpu", "--engine", "hf"]) == 2
    err = capsys.readouterr().err
    assert _problem_lines(err) == checked and "launch refused before starting anything" in err
    assert not list((tmp_path / "out" / "launch").glob("server-*.log"))  # nothing started
    assert not (tmp_path / "out" / "launch" / "pids.json").exists()  # and no claim left behind


def test_a_missing_class_list_is_named_before_anything_loads(
    write_yaml, shapes: dict[str, Path], capsys
) -> None:
    model = Path(write_yaml("model/config.json", {})).parent  # a directory with a config.json
    cfg = _config(model, shapes["train"])
    cfg["data"]["prompt"] = "Detect these classes: {labels}."  # no <train>.labels.json beside the records
    assert main(["check-config", str(write_yaml("c.yaml", cfg))]) == 2
    err = capsys.readouterr().err
    assert "data.labels" in err and "train.labels.json" in err
    cfg["data"]["labels"] = "names.json"  # a file, relative to the config file's folder
    assert main(["check-config", str(write_yaml("d.yaml", cfg))]) == 2
    assert "file not found" in capsys.readouterr().err
