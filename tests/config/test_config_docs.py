"""docs/config.md is generated from the schema and must be current; every key is documented."""

from __future__ import annotations

from pathlib import Path

from rollmatch.config.docs import iter_schema_fields, render_markdown
from rollmatch.config.rules import STATIC_RULES

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_committed_docs_match_the_schema() -> None:
    assert DOC.read_text(encoding="utf-8") == render_markdown(), (
        "docs/config.md is stale: run `python -m rollmatch.config.docs > docs/config.md`"
    )


def test_every_key_has_a_description_and_a_row() -> None:
    text = render_markdown()
    for field in iter_schema_fields():
        if field.section is None:
            assert field.description, f"{field.path}: add a Field description in rollmatch/config/schema.py"
            assert f"| `{field.path}` |" in text
        else:
            assert field.section.__dict__.get("__doc__"), f"{field.section.__name__}: add a class docstring"


def test_rules_are_listed() -> None:
    text = render_markdown()
    for rule in STATIC_RULES:
        assert rule.__doc__ and rule.__doc__.strip() in text
    assert "custom.extra.rollout_matching.rollout_buffer" in text
    assert "## Loading" in text and "extends" in text
