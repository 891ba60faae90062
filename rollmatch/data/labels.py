"""The dataset's class names in the prompt (``{labels}`` in ``data.prompt``).

Owns: where a run's label list comes from (:func:`resolve_labels`: ``data.labels`` inline, a file, or
the ``<stem>.labels.json`` that ``rollmatch data convert`` writes beside its JSONL), reading and
writing such files, and :class:`PromptLabels`, which fills the placeholder per record. Large
vocabularies (LVIS: 1,203 names) do not fit a prompt: with ``data.prompt_max_labels`` a record lists
its own labels plus negatives drawn from the rest, shuffled, deterministic per record id and seed (as
Rex-Omni prompts), so a rollout of the same record sees the same prompt in every epoch and process.

Leaves out: the chat template and image processing (``data.prompts``) and counting predicted labels
outside the list (``detection.scoring`` callers, through :attr:`PromptLabels.names`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

# The naming rule lives with the input checks (check-config finds a missing list before anything loads).
from rollmatch.config.input_files import LABELS_PLACEHOLDER, LABELS_SUFFIX, labels_file_for  # noqa: F401
from rollmatch.errors import ConfigError, ConfigProblem

if TYPE_CHECKING:
    from rollmatch.config.schema import DataConfig

LABEL_SEPARATOR = ", "


def write_label_file(path: str | Path, names: Iterable[str]) -> Path:
    """Write ``names`` (in the given order, duplicates dropped) as a JSON list."""
    unique = list(dict.fromkeys(names))
    Path(path).write_text(json.dumps(unique, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    return Path(path)


def read_label_file(path: str | Path, key: str = "data.labels") -> list[str]:
    """A JSON list of names, or one name per line (blank lines skipped); errors name ``key``."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(
            [ConfigProblem(key, str(path), "no such label file; give a list or an existing file")]
        )
    text = file.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            names = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                [ConfigProblem(key, str(path), f"not valid JSON ({exc}); fix the file")]
            ) from exc
    else:
        names = [line.strip() for line in text.splitlines() if line.strip()]
    return _checked(names, key, str(path))


def resolve_labels(data: DataConfig) -> list[str] | None:
    """The run's class names: ``data.labels`` (inline or a file), else, when ``data.prompt`` has
    ``{labels}``, the list beside ``data.train_jsonl``; None when neither applies."""
    if isinstance(data.labels, list):
        return _checked(data.labels, "data.labels", data.labels)
    if isinstance(data.labels, str):
        return read_label_file(data.labels)
    if LABELS_PLACEHOLDER not in data.prompt:
        return None
    beside = labels_file_for(data.train_jsonl)
    if not beside.is_file():
        raise ConfigError(
            [
                ConfigProblem(
                    "data.labels",
                    None,
                    f"data.prompt lists {LABELS_PLACEHOLDER} but there is no {beside} (written by `rollmatch "
                    "data convert`); set data.labels to the class names or to a file of them",
                )
            ]
        )
    return read_label_file(beside)


@dataclass(frozen=True)
class PromptLabels:
    """A run's class names and how many of them one prompt lists."""

    names: tuple[str, ...]
    max_labels: int | None = None  # data.prompt_max_labels; None: every name
    seed: int = 0  # training.seed

    def for_record(self, record_id: str, positives: Sequence[str]) -> list[str]:
        """The names one record's prompt lists: all of them, or (over ``max_labels``) the record's own
        labels plus negatives drawn from the rest, shuffled; the same for the same record and seed."""
        if self.max_labels is None or len(self.names) <= self.max_labels:
            return list(self.names)
        own = list(dict.fromkeys(positives))
        others = [name for name in self.names if name not in set(own)]
        rng = random.Random(f"{self.seed}:{record_id}")  # str seeds hash deterministically (sha512)
        picked = own + rng.sample(others, max(0, min(len(others), self.max_labels - len(own))))
        rng.shuffle(picked)
        return picked

    def fill(self, prompt: str, record_id: str, positives: Sequence[str]) -> str:
        """``prompt`` with ``{labels}`` replaced by this record's list (a prompt without it unchanged)."""
        if LABELS_PLACEHOLDER not in prompt:
            return prompt
        return prompt.replace(LABELS_PLACEHOLDER, LABEL_SEPARATOR.join(self.for_record(record_id, positives)))


def prompt_labels(data: DataConfig, seed: int) -> PromptLabels | None:
    """The :class:`PromptLabels` of a config (None when the run has no label list)."""
    names = resolve_labels(data)
    if names is None:
        if LABELS_PLACEHOLDER in data.prompt:  # unreachable: resolve_labels raised
            raise AssertionError("resolve_labels returned None with the placeholder in the prompt")
        return None
    return PromptLabels(tuple(names), data.prompt_max_labels, seed)


def _checked(names: object, key: str, value: object) -> list[str]:
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n.strip() for n in names):
        raise ConfigError([ConfigProblem(key, value, "give a non-empty list of non-empty class names")])
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError([ConfigProblem(key, value, f"names listed twice: {duplicates}; list each once")])
    return list(names)
