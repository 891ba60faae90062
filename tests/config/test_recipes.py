"""Every recipe under configs/recipes/ passes `rollmatch check-config` on one node and on two, with
``model.path`` pointed at a tiny stand-in of the recipe's family, and resolves to the frame it states."""

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


def _family(recipe: Path) -> str:
    return "qwen2_5_vl" if recipe.name.startswith("qwen2_5_vl") else "qwen3_vl"


def _stated_frame(recipe: Path) -> str:
    model_file = REPO / "configs" / "recipes" / "models" / (recipe.stem.rsplit("_", 1)[0] + ".yaml")
    found = re.search(r"auto resolves to `(\w+)`", model_file.read_text())
    assert found, f"{model_file} does not state its coordinate frame"
    return found.group(1)


def test_every_model_and_dataset_has_a_recipe() -> None:
    names = {p.stem for p in RECIPES}
    for model in ("qwen2_5_vl_3b", "qwen2_5_vl_7b", "qwen3_vl_2b", "qwen3_vl_4b", "qwen3_vl_8b"):
        for data in ("coco", "lvis", "odinw", "refcoco"):
            assert f"{model}_{data}" in names


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Stand-ins for the recipes' converted records (the input checks read them)."""
    from rollmatch.data.shapes import generate_shapes

    return generate_shapes(tmp_path_factory.mktemp("recipe_records"), n_train=4, n_val=2, size=112, seed=0)


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
    ranks = len(cfg.launch.learner_devices) * (2 if nodes == "two_nodes" else 1)
    assert check_runtime(cfg, world_size=ranks, device_count=8, device_type="cuda") == []
