"""Checkpoints a run can trust: rotation waits for completeness, resume refuses what would resume wrongly.

Fault injection: the write of a rank's rollmatch state (between HF's files and the completion marker)
raises, as a crash mid-save would.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from fork_ranks import run_forked_ranks

from rollmatch.config.load import config_to_yaml
from rollmatch.errors import ConfigError
from rollmatch.training import checkpoints
from rollmatch.training.checkpoints import (
    COMPLETE_MARKER,
    resolve_resume,
    rotate_checkpoints,
    write_complete_marker,
)
from rollmatch.training.entry import run_training


class SimulatedCrash(RuntimeError):
    pass


def make_checkpoint(root: Path, step: int, *, complete: bool, world_size: int = 1) -> Path:
    folder = root / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"")
    if complete:
        write_complete_marker(str(folder), step, world_size)
    return folder


def sft_config(make_config: Any, out: Path, **training: Any) -> Any:
    return make_config(
        {
            "custom": {"trainer_variant": "sft"},
            "training": {"output_dir": str(out), "per_device_train_batch_size": 2, **training},
        }
    )


# ---------------------------------------------------------------------------------- end to end
@pytest.mark.heavy
def test_a_crash_before_the_marker_keeps_the_previous_checkpoint(make_config, tmp_path, monkeypatch, caplog):
    out = tmp_path / "out"

    def config(resume: str | None = None) -> Any:
        return sft_config(
            make_config, out, max_steps=4, save_steps=2, save_total_limit=1, resume_from_checkpoint=resume
        )

    save_rank_state = checkpoints.save_rank_state

    def crash_at_step_4(folder: str, rank: int, state: dict[str, Any]) -> None:
        if folder.endswith("checkpoint-4"):
            raise SimulatedCrash(f"killed while saving {folder}")
        save_rank_state(folder, rank, state)

    with monkeypatch.context() as patch:
        patch.setattr(checkpoints, "save_rank_state", crash_at_step_4)
        with pytest.raises(SimulatedCrash, match="checkpoint-4"):
            run_training(config())
    assert (out / "checkpoint-4" / "model.safetensors").exists()  # HF's part was written
    assert not (out / "checkpoint-4" / COMPLETE_MARKER).exists()
    assert (out / "checkpoint-2" / COMPLETE_MARKER).exists(), (
        "save_total_limit: 1 deleted the only complete one"
    )

    with pytest.raises(ConfigError, match=r"checkpoint-4.*incomplete checkpoint.*use `latest`"):
        run_training(config(str(out / "checkpoint-4")))

    with caplog.at_level(logging.WARNING, logger="rollmatch.config.resume"):
        resumed = run_training(config("latest"))
    assert "skipping incomplete checkpoint(s) checkpoint-4" in caplog.text
    assert resumed.global_step == 4
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in logged if "loss" in h] == [1, 2, 3, 4, 3, 4]  # crashed run, then from step 2
    marker = json.loads((out / "checkpoint-4" / COMPLETE_MARKER).read_text())
    assert marker == {"global_step": 4, "world_size": 1}
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"]  # rotated once complete


@pytest.mark.heavy
def test_a_resumed_run_saves_at_its_own_interval(make_config, tmp_path):
    """HF restores the checkpoint's save_steps on resume; the resumed run's config must win."""
    out = tmp_path / "out"
    run_training(sft_config(make_config, out, max_steps=4, save_steps=4))
    resumed = run_training(
        sft_config(
            make_config,
            out,
            max_steps=7,
            save_steps=1,
            save_total_limit=None,
            resume_from_checkpoint="latest",
        )
    )
    assert resumed.global_step == 7
    saved = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert saved == [4, 5, 6, 7], saved


@pytest.mark.heavy
def test_two_ranks_refuse_a_checkpoint_saved_by_one(make_config, tmp_path, capfd):
    # Two real gloo ranks forked from this process (tests/fork_ranks.py): the check is ours, not torchrun's.
    out = tmp_path / "out"
    make_checkpoint(out, 2, complete=True, world_size=1)
    cfg = sft_config(make_config, out, max_steps=4, resume_from_checkpoint="latest")
    codes = run_forked_ranks(lambda rank: run_training(cfg), timeout_s=120, check=False)
    stderr = capfd.readouterr().err
    assert codes == {0: 1, 1: 1}, (codes, stderr[-4000:])
    assert "was saved by 1 learner process(es), this run has 2" in stderr, stderr[-4000:]
    assert not (out / "metrics.jsonl").exists()  # refused before training started


# ---------------------------------------------------------------------------------- resume choice
def test_an_explicit_path_without_marker_is_refused(tmp_path):
    folder = make_checkpoint(tmp_path, 4, complete=False)
    with pytest.raises(ConfigError) as refused:
        resolve_resume(str(folder), str(tmp_path), world_size=1)
    (problem,) = refused.value.problems
    assert problem.key == "training.resume_from_checkpoint" and problem.value == str(folder)
    assert "incomplete checkpoint" in problem.fix and "crashed while saving" in problem.fix
    assert "`latest`" in problem.fix


def test_an_explicit_complete_path_resumes(tmp_path):
    folder = make_checkpoint(tmp_path, 2, complete=True)
    assert resolve_resume(str(folder), str(tmp_path), world_size=1) == str(folder)


def test_latest_skips_newer_incomplete_checkpoints_and_names_them(tmp_path, caplog):
    make_checkpoint(tmp_path, 2, complete=True)
    make_checkpoint(tmp_path, 10, complete=True)
    make_checkpoint(tmp_path, 12, complete=False)
    with caplog.at_level(logging.WARNING, logger="rollmatch.config.resume"):
        chosen = resolve_resume("latest", str(tmp_path), world_size=1)
    assert chosen == str(tmp_path / "checkpoint-10")  # by step, not by name (10 > 2)
    assert "checkpoint-12" in caplog.text


def test_latest_without_checkpoints_starts_at_step_zero(tmp_path):
    assert resolve_resume("latest", str(tmp_path / "not-yet"), world_size=1) is None
    assert resolve_resume("latest", str(tmp_path), world_size=1) is None
    assert resolve_resume(None, str(tmp_path), world_size=1) is None
    assert resolve_resume("auto", str(tmp_path), world_size=1) is None


# ------------------------------------------------------------------ never start over a run's own work
def test_auto_is_the_default_and_resumes_the_newest_complete_checkpoint(tmp_path):
    from rollmatch.config.schema import RollmatchConfig

    assert RollmatchConfig().training.resume_from_checkpoint == "auto"
    make_checkpoint(tmp_path, 2, complete=True)
    make_checkpoint(tmp_path, 4, complete=True)
    assert resolve_resume("auto", str(tmp_path), world_size=1) == str(tmp_path / "checkpoint-4")


def test_a_fresh_start_over_complete_checkpoints_is_refused_unless_overwrite(tmp_path, caplog):
    make_checkpoint(tmp_path, 2, complete=True)
    make_checkpoint(tmp_path, 6, complete=False)  # only complete ones are work to lose
    with pytest.raises(ConfigError) as refused:
        resolve_resume(None, str(tmp_path), world_size=1)
    (problem,) = refused.value.problems
    assert problem.key == "training.resume_from_checkpoint" and problem.value is None
    assert f"{tmp_path} holds complete checkpoint(s) of an earlier run (checkpoint-2)" in problem.fix
    assert "training.resume_from_checkpoint: auto" in problem.fix
    assert "training.overwrite_output_dir: true" in problem.fix
    with caplog.at_level(logging.WARNING, logger="rollmatch.config.resume"):
        assert resolve_resume(None, str(tmp_path), world_size=1, overwrite=True) is None
        assert resolve_resume("auto", str(tmp_path), world_size=1, overwrite=True) is None
    assert "starting at step 0" in caplog.text and "checkpoint-2" in caplog.text
    # an explicit resume still resumes (the Slurm script's requeue adds `latest`)
    assert resolve_resume("latest", str(tmp_path), world_size=1, overwrite=True) == str(
        tmp_path / "checkpoint-2"
    )


def test_the_trainer_refuses_a_fresh_start_before_loading_anything(make_config, tmp_path):
    out = tmp_path / "out"
    make_checkpoint(out, 3, complete=True)
    with pytest.raises(
        ConfigError, match=r"holds complete checkpoint\(s\) of an earlier run \(checkpoint-3\)"
    ):
        run_training(sft_config(make_config, out, max_steps=1, resume_from_checkpoint=None))
    assert not (out / "metrics.jsonl").exists()


def test_check_config_applies_the_same_rule(make_config, tmp_path, capsys):
    from rollmatch.cli import main

    out = tmp_path / "out"
    path = tmp_path / "run.yaml"
    path.write_text(config_to_yaml(sft_config(make_config, out)))
    assert main(["check-config", str(path)]) == 0  # nothing saved yet
    assert "training starts from step 0" in capsys.readouterr().err
    make_checkpoint(out, 3, complete=True)
    assert main(["check-config", str(path)]) == 0  # the default, auto: the rerun resumes
    assert f"training starts from {out / 'checkpoint-3'}" in capsys.readouterr().err
    assert main(["check-config", str(path), "training.resume_from_checkpoint=null"]) == 2
    err = capsys.readouterr().err
    assert "training.resume_from_checkpoint" in err and "training.overwrite_output_dir: true" in err


def test_latest_refuses_when_checkpoints_exist_but_none_is_complete(tmp_path):
    make_checkpoint(tmp_path, 2, complete=False)
    make_checkpoint(tmp_path, 4, complete=False)
    with pytest.raises(
        ConfigError, match=r"none is complete \(checkpoint-2, checkpoint-4.*restart from step 0"
    ):
        resolve_resume("latest", str(tmp_path), world_size=1)


@pytest.mark.parametrize("spec", ["latest", "path"])
@pytest.mark.parametrize(("saved", "now"), [(2, 1), (1, 2)])
def test_another_world_size_is_refused(tmp_path, spec, saved, now):
    folder = make_checkpoint(tmp_path, 2, complete=True, world_size=saved)
    with pytest.raises(ConfigError) as refused:
        resolve_resume("latest" if spec == "latest" else str(folder), str(tmp_path), world_size=now)
    fix = refused.value.problems[0].fix
    assert f"saved by {saved} learner process(es), this run has {now}" in fix
    assert f"Relaunch with {saved} learner process(es)" in fix
    assert resolve_resume(str(folder), str(tmp_path), world_size=saved) == str(folder)


# ---------------------------------------------------------------------------------- rotation
def test_rotation_counts_complete_checkpoints_and_keeps_the_best(tmp_path):
    for step, complete in [(1, True), (2, True), (3, False), (4, True), (5, True)]:
        make_checkpoint(tmp_path, step, complete=complete)
    current, best = str(tmp_path / "checkpoint-5"), str(tmp_path / "checkpoint-2")
    assert rotate_checkpoints(str(tmp_path), None, keep=(current,)) == []
    deleted = rotate_checkpoints(str(tmp_path), 2, keep=(current, best))
    assert sorted(Path(p).name for p in deleted) == ["checkpoint-1", "checkpoint-3", "checkpoint-4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-5"]


def test_rotation_never_deletes_the_checkpoint_it_protects(tmp_path):
    make_checkpoint(tmp_path, 8, complete=True)  # newer by step, from a run resumed at an older one
    current = str(make_checkpoint(tmp_path, 6, complete=True))
    rotate_checkpoints(str(tmp_path), 1, keep=(current, None))
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-6"]
