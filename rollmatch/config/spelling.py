"""How a user wrote a config: the short ``rollout:`` section, and the overrides, so every message names a
key the way the user wrote it.

Owns :data:`SHORT_ROLLOUT_KEY` (``rollout``, the short form of ``custom.extra.rollout_matching``),
:func:`expand_short_rollout` (one raw layer's ``rollout:`` moved to its long spelling, before the
layers merge; a layer that sets both spellings is refused) and :class:`Spelling` (what the loader saw,
kept on the loaded config by :func:`remember_spelling`): :meth:`Spelling.as_written` rewrites
problems to the user's spelling and marks those an override set. Both spellings stay valid; the
schema, the saved configs and docs/config.md use the long one, the spec's.

Leaves out: the older spellings that moved or went (``config.legacy``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollmatch.config.schema import ROLLOUT_KEY, RollmatchConfig
from rollmatch.errors import ConfigProblem

SHORT_ROLLOUT_KEY = "rollout"


def expand_short_rollout(
    layer: Mapping[str, Any], source: str
) -> tuple[dict[str, Any], list[ConfigProblem], bool, bool]:
    """``layer`` with its top-level ``rollout:`` moved to ``custom.extra.rollout_matching``.

    Returns ``(layer, problems, short, long)``: ``short``/``long`` say which spellings the layer
    used; a layer with both gets a problem (one would silently override the other) and keeps the
    long one. The input is not modified.
    """
    data: dict[str, Any] = copy.deepcopy(dict(layer))
    long = _has_long(data)
    if SHORT_ROLLOUT_KEY not in data:
        return data, [], False, long
    short = data.pop(SHORT_ROLLOUT_KEY)
    if long:
        problem = ConfigProblem(
            SHORT_ROLLOUT_KEY,
            f"set in {source}",
            f"both `{SHORT_ROLLOUT_KEY}:` and its long spelling `{ROLLOUT_KEY}` are set in {source}; keep "
            f"one (`{SHORT_ROLLOUT_KEY}:` is the short form) and move every rollout setting into it",
        )
        return data, [problem], True, True
    custom = data.setdefault("custom", {})
    if not isinstance(custom, dict):
        return {**data, SHORT_ROLLOUT_KEY: short}, [], True, False  # pydantic names the bad `custom`
    extra = custom.setdefault("extra", {})
    if not isinstance(extra, dict):
        return {**data, SHORT_ROLLOUT_KEY: short}, [], True, False
    extra["rollout_matching"] = short
    return data, [], True, False


@dataclass(frozen=True)
class Spelling:
    """What the loader saw. ``short_rollout``: the config spells the rollout section ``rollout:`` (some
    layer used the short form and none the long one); ``overrides`` as given."""

    short_rollout: bool = False
    overrides: tuple[str, ...] = ()

    def key(self, key: str) -> str:
        """``key`` (long spelling) as the user wrote it."""
        return _short(key) if self.short_rollout else key

    def as_written(self, problems: Sequence[ConfigProblem]) -> list[ConfigProblem]:
        """``problems`` in the user's spelling, each set by an override marked so, duplicates dropped."""
        seen: set[str] = set()
        written: list[ConfigProblem] = []
        for problem in problems:
            fix = _short(problem.fix) if self.short_rollout else problem.fix
            origin = self._override_of(problem.key)
            if origin is not None and "<overrides>" not in fix:
                fix = f"{fix} (set by override `{origin}`)"
            shown = ConfigProblem(self.key(problem.key), problem.value, fix)
            if str(shown) not in seen:
                seen.add(str(shown))
                written.append(shown)
        return written

    def _override_of(self, problem_key: str) -> str | None:
        for text in self.overrides:
            key = _long(text.partition("=")[0].strip())
            if key and any(
                a == b or a.startswith(b + ".") or a.startswith(b + "[")
                for a, b in ((problem_key, key), (key, problem_key))
            ):
                return text
        return None


def remember_spelling(cfg: RollmatchConfig, spelling: Spelling) -> RollmatchConfig:
    """Keep ``spelling`` on ``cfg`` (a private attribute: not a key, not dumped; copies keep it)."""
    cfg._spelling = spelling
    return cfg


def spelling_of(cfg: RollmatchConfig) -> Spelling:
    """The spelling ``cfg`` was loaded with (the long one for a config built in code)."""
    spelling = cfg._spelling
    return spelling if isinstance(spelling, Spelling) else Spelling()


def _has_long(data: Mapping[str, Any]) -> bool:
    custom = data.get("custom")
    extra = custom.get("extra") if isinstance(custom, Mapping) else None
    return isinstance(extra, Mapping) and "rollout_matching" in extra


def _short(text: str) -> str:
    return text.replace(ROLLOUT_KEY, SHORT_ROLLOUT_KEY)


def _long(key: str) -> str:
    if key == SHORT_ROLLOUT_KEY or key.startswith(SHORT_ROLLOUT_KEY + "."):
        return ROLLOUT_KEY + key[len(SHORT_ROLLOUT_KEY) :]
    return key
