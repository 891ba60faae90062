"""Every recipe under configs/recipes/ passes `rollmatch check-config` on one node and on two, with
``model.path`` pointed at a tiny stand-in of the recipe's family, and resolves to the frame it states;
each Stage-2 recipe starts from its stage-1 recipe's output; every recipe trains fp32 master weights
with bf16 compute."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rollmatch.cli import main
from rollmatch.config.load import load_config
from rollmatch.config.rules import check_runtime

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "configs" / "recipes").glob("*.yaml"))
TWO_NODES = [
    "launch.nodes.count=2",
    "launch.nodes.rank=1",
    "launch.port_base=8000",
    "launch.nodes.hosts=[node0,node1]",
    "launch.nodes.rendezvous=node0:29500",
]


MODELS = ("qwen2_5_vl_3b", "qwen2_5_vl_7b", "qwen3_vl_2b", "qwen3_vl_4b", "qwen3_vl_8b")
DATASETS = ("coco", "lvis", "odinw", "refcoco")


def _family(recipe: Path) -> str:
    return "qwen2_5_vl" if recipe.name.startswith("qwen2_5_vl") else "qwen3_vl"


def _model(recipe: Path) -> str:
    return next(m for m in MODELS if recipe.stem.startswith(m + "_"))


def _stated_frame(recipe: Path) -> str:
    model_file = REPO / "configs" / "recipes" / "models" / (_model(recipe) + ".yaml")
    found = re.search(r"auto resolves to `(\w+)`", model_file.read_text())
    assert found, f"{model_file} does not state its coordinate frame"
    return found.group(1)


def test_every_model_and_dataset_has_a_stage1_and_a_stage2_recipe() -> None:
    names = {p.stem for p in RECIPES}
    assert names == {f"{m}_{d}{stage}" for m in MODELS for d in DATASETS for stage in ("", "_stage1")}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("data", DATASETS)
def test_stage2_starts_from_the_stage1_output(model: str, data: str) -> None:
    stage1 = load_config(REPO / "configs" / "recipes" / f"{model}_{data}_stage1.yaml")
    stage2 = load_config(REPO / "configs" / "recipes" / f"{model}_{data}.yaml")
    assert stage1.custom.trainer_variant == "sft" and stage1.custom.object_format == "qwen_json"
    assert stage2.custom.trainer_variant == "stage2_ab_training"
    assert stage2.model.path == f"{stage1.training.output_dir}/final"
    assert stage1.model.path.endswith("-Instruct")
    # the class names in the prompt (refcoco: each record's own phrase), the same in both stages
    assert stage1.data.prompt == stage2.data.prompt
    assert ("{labels}" in stage1.data.prompt) == (data != "refcoco")
    for cfg in (stage1, stage2):  # fp32 master weights, bf16 compute
        assert (cfg.model.dtype, cfg.training.mixed_precision) == ("float32", "bf16")


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Stand-ins for the recipes' converted records (the input checks read them)."""
    from rollmatch.data.labels import labels_file_for, write_label_file
    from rollmatch.data.records import load_records
    from rollmatch.data.shapes import generate_shapes

    paths = generate_shapes(tmp_path_factory.mktemp("recipe_records"), n_train=4, n_val=2, size=112, seed=0)
    # `data convert` writes the class names beside its JSONL; the recipes' {labels} prompt reads them
    names = sorted({obj.label for record in load_records(paths["train"]) for obj in record.objects})
    write_label_file(labels_file_for(paths["train"]), names)
    return paths


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
@pytest.mark.parametrize("nodes", ["one_node", "two_nodes"])
def test_recipe_passes_check_config(
    recipe: Path,
    nodes: str,
    tiny_model_dirs: dict[str, Path],
    records: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    monkeypatch.chdir(tmp_path)  # input paths resolve against the recipe's file, not the working directory
    overrides = [
        f"model.path={tiny_model_dirs[_family(recipe)]}",
        f"data.train_jsonl={records['train']}",
        f"data.val_jsonl={records['val']}",
        *(TWO_NODES if nodes == "two_nodes" else []),
    ]
    code = main(["check-config", str(recipe), *overrides])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"data.coord_frame: auto -> {_stated_frame(recipe)}" in err
    cfg = load_config(recipe, overrides)
    per_node = (
        8 if cfg.custom.trainer_variant == "sft" else len(cfg.launch.learner_devices)
    )  # stage 1: whole node
    ranks = per_node * (2 if nodes == "two_nodes" else 1)
    assert check_runtime(cfg, world_size=ranks, device_count=8, device_type="cuda") == []
