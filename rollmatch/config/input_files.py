"""The files a run reads before it starts: where their paths point and whether they are there.

Owns: :data:`INPUT_PATH_KEYS` (the config keys that name an input file or directory),
:func:`anchor_input_paths` (a config file's relative input paths resolved against that file's
directory, as ``extends:`` is) and :func:`input_file_problems` (one problem per missing file, a
model hub id told to download first). ``rollmatch check-config``, ``train`` and ``launch`` run the
same check before anything heavy, so all three refuse the same configs with the same message.

Leaves out: the record-length scan, which needs the processor (``data.input_checks``), and outputs
(``training.output_dir`` stays relative to the working directory: a run writes where it is started).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rollmatch.config.hf_args import eval_strategy
from rollmatch.config.schema import RollmatchConfig
from rollmatch.errors import ConfigProblem

# (section, key) of every input path a config file may set.
INPUT_PATH_KEYS: tuple[tuple[str, str], ...] = (
    ("model", "path"),
    ("data", "train_jsonl"),
    ("data", "val_jsonl"),
    ("data", "labels"),  # only where it names a file (an inline list of names stays as written)
    ("training", "deepspeed"),
)
LABELS_PLACEHOLDER = "{labels}"  # in data.prompt: the run's class names
LABELS_SUFFIX = ".labels.json"
# `owner/name` as the Hugging Face hub spells a repository (no leading `.`, `/` or `~`).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_hub_id(value: str) -> bool:
    """``Qwen/Qwen2.5-VL-3B-Instruct``: one ``owner/name`` pair, not a path that exists."""
    return bool(_HUB_ID.match(value)) and not Path(value).exists()


def anchor_input_paths(data: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    """``data`` (one config file's mapping) with its relative input paths made absolute against ``base_dir``.

    A ``model.path`` that reads as a hub id and names nothing under ``base_dir`` is kept as written,
    so the check can say "download it first" instead of "not found: <dir>/Qwen/...".
    """
    for section, key in INPUT_PATH_KEYS:
        node = data.get(section)
        if not isinstance(node, dict) or not isinstance(node.get(key), str):
            continue
        value = node[key]
        path = Path(value).expanduser()
        if path.is_absolute():
            continue
        anchored = (base_dir / path).resolve()
        if (section, key) == ("model", "path") and _HUB_ID.match(value) and not anchored.exists():
            continue
        node[key] = str(anchored)
    return data


def absolute_input_paths(cfg: RollmatchConfig, base_dir: Path) -> None:
    """Make ``cfg``'s relative input paths absolute against ``base_dir`` (in place): a config written
    elsewhere (``launch``'s learner.yaml) must not re-anchor an override's path to its own folder."""
    for section, key in INPUT_PATH_KEYS:
        node = getattr(cfg, section)
        value = getattr(node, key)
        if (
            isinstance(value, str)
            and not Path(value).expanduser().is_absolute()
            and not looks_like_hub_id(value)
        ):
            setattr(node, key, str((base_dir / Path(value).expanduser()).resolve()))


def labels_file_for(jsonl: str | Path) -> Path:
    """Where ``data convert`` puts the class names of ``jsonl``: ``train.jsonl`` -> ``train.labels.json``."""
    path = Path(jsonl)
    stem = path.name.removesuffix(".jsonl") if path.name.endswith(".jsonl") else path.stem
    return path.with_name(stem + LABELS_SUFFIX)


def input_file_problems(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """One problem per input that is not there: the model directory, the records, the class names."""
    problems = _model_problems(cfg.model.path)
    problems.extend(_file_problem("data.train_jsonl", cfg.data.train_jsonl, _RECORDS_FIX))
    if cfg.data.val_jsonl is not None and _reads_val(cfg):
        problems.extend(_file_problem("data.val_jsonl", cfg.data.val_jsonl, _RECORDS_FIX))
    problems.extend(_labels_problems(cfg))
    return problems  # training.deepspeed: read by the static rules already (config.sharding)


def _labels_problems(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """A ``data.labels`` file that is not there, or ``{labels}`` in the prompt with no list beside the records."""
    if isinstance(cfg.data.labels, str):
        return _file_problem("data.labels", cfg.data.labels, _LABELS_FIX)
    if cfg.data.labels is not None or LABELS_PLACEHOLDER not in cfg.data.prompt:
        return []
    if not Path(cfg.data.train_jsonl).is_file():
        return []  # the records' own problem says it
    beside = labels_file_for(cfg.data.train_jsonl)
    if beside.is_file():
        return []
    return [
        ConfigProblem(
            "data.labels",
            None,
            f"data.prompt lists {LABELS_PLACEHOLDER} but there is no {beside} (written by `rollmatch data "
            "convert`); set data.labels to the class names or to a file of them",
        )
    ]


_LABELS_FIX = (
    "a JSON list of class names or one name per line (`rollmatch data convert` writes `<out>.labels.json`)"
)
_RECORDS_FIX = "make the records with `rollmatch data convert` (docs/data.md) or fix the path"
_WHERE = "relative paths in a config file resolve against that file's directory, on the command line against the working directory"


def _reads_val(cfg: RollmatchConfig) -> bool:
    """Validation records are read by in-training evaluation only."""
    return eval_strategy(cfg) != "no"


def _model_problems(value: str) -> list[ConfigProblem]:
    path = Path(value).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return []
        return [
            ConfigProblem(
                "model.path",
                value,
                f"{path.resolve()} holds no config.json: point model.path at a Hugging Face model directory "
                "(the folder `save_pretrained` or `huggingface-cli download --local-dir` wrote)",
            )
        ]
    if looks_like_hub_id(value):
        return [
            ConfigProblem(
                "model.path",
                value,
                f"a model hub id, not a local directory: rollmatch loads local checkpoints only. Download it "
                f"first (e.g. `huggingface-cli download {value} --local-dir /ckpt/{value.split('/')[1]}`) "
                "and set model.path to the local directory",
            )
        ]
    return [
        ConfigProblem("model.path", value, f"directory not found: {path.resolve()} ({_WHERE}); fix the path")
    ]


def _file_problem(key: str, value: str, fix: str) -> list[ConfigProblem]:
    path = Path(value).expanduser()
    if path.is_file():
        return []
    state = "is a directory, not a file" if path.is_dir() else "file not found"
    return [ConfigProblem(key, value, f"{state}: {path.resolve()} ({_WHERE}); {fix}")]
