"""The config reference, generated from the schema: ``python -m rollmatch.config.docs > docs/config.md``.

Owns: walking the schema (:func:`iter_schema_fields`, :func:`section_fields`, used also for
"did you mean" hints) and rendering docs/config.md: every key with its dotted path, type, default
and description (taken from the ``Field`` descriptions and section docstrings in
``config.schema``), plus the loading rules and the fail-fast rules list (from ``config.rules`` and
``config.legacy``). Leaves out: any fact not stated in those modules; edit them, then regenerate.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from rollmatch.config.legacy import ALIASED_SECTIONS, REJECTED_KEYS
from rollmatch.config.rules import RUNTIME_RULE_DESCRIPTIONS, rule_descriptions
from rollmatch.config.schema import RollmatchConfig


@dataclass(frozen=True)
class SchemaField:
    """One key of the schema: dotted path (YAML spelling), type, default, description."""

    path: str
    type_name: str
    default: Any
    required: bool
    description: str
    section: type[BaseModel] | None  # set when the key holds a nested section


def section_fields(model: type[BaseModel]) -> dict[str, FieldInfo]:
    """YAML key (the alias where one is set) -> field, in declaration order."""
    return {(info.alias or name): info for name, info in model.model_fields.items()}


def section_class(annotation: Any) -> type[BaseModel] | None:
    """The section model an annotation holds directly (not inside a list or union), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def list_item_section(annotation: Any) -> type[BaseModel] | None:
    """The section model of ``list[Section]`` (optionally ``| None``), else None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(candidate) is list:
            return section_class(typing.get_args(candidate)[0])
    return None


def iter_schema_fields(model: type[BaseModel] = RollmatchConfig, prefix: str = "") -> Iterator[SchemaField]:
    """Every key under ``model`` depth-first; a section is yielded before its own keys."""
    for key, info in section_fields(model).items():
        path = f"{prefix}{key}"
        section = section_class(info.annotation)
        yield SchemaField(
            path=path,
            type_name=type_name(info.annotation),
            default=None if section else _default_of(info),
            required=info.is_required(),
            description=(info.description or "").strip(),
            section=section,
        )
        if section is not None:
            yield from iter_schema_fields(section, f"{path}.")
        item = list_item_section(info.annotation)
        if item is not None:  # e.g. `servers`: document the keys of one list entry as `servers[]`
            yield SchemaField(f"{path}[]", item.__name__, None, False, "", item)
            yield from iter_schema_fields(item, f"{path}[].")


def type_name(annotation: Any) -> str:
    """A short readable type: ``int | null``, ``"micro" | "step"``, ``list[ServerEndpoint]``."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(v) for v in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in typing.get_args(annotation))
    if origin is list:
        return f"list[{', '.join(type_name(arg) for arg in typing.get_args(annotation))}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def render_markdown() -> str:
    """The full text of docs/config.md."""
    lines = [*_header(), *_rules_section(), "## Keys", ""]
    fields = list(iter_schema_fields())
    sections = [("", RollmatchConfig)] + [(f.path, f.section) for f in fields if f.section is not None]
    for path, model in sections:
        leaves = [f for f in fields if _parent(f.path) == path and f.section is None]
        if not leaves:
            continue
        doc = (model.__dict__.get("__doc__") or "").strip()
        lines += [f"### `{path}`" if path else "### top level", ""]
        lines += [doc, ""] if doc else []
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for f in leaves:
            default = "required" if f.required else f"`{json.dumps(f.default)}`"
            lines.append(_table_row(f"`{f.path}`", f"`{f.type_name}`", default, f.description))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    print(render_markdown(), end="")


# ------------------------------------------------------------------------------------ private helpers
def _default_of(info: FieldInfo) -> Any:
    if info.default_factory is not None:
        return info.default_factory()  # type: ignore[call-arg]
    return None if info.is_required() else info.default


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _table_row(*cells: str) -> str:
    """One markdown table row; ``|`` inside a cell (union types) is escaped to keep the columns."""
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def _header() -> list[str]:
    return [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m rollmatch.config.docs > docs/config.md` from rollmatch/config/schema.py;",
        "     edit the Field descriptions there and regenerate (a test checks this file is current). -->",
        "",
        "A run is configured by one YAML file validated against a typed schema: unknown keys are errors,",
        "every default is listed below, and every problem is reported at once (key, value received, fix).",
        "",
        "## Loading",
        "",
        "- `extends: base.yaml` (or a list of files, merged in order) loads the base first; the path is",
        "  relative to the extending file and may chain. Mappings merge key by key; lists and scalars",
        "  are replaced; a cycle is an error.",
        "- Overrides on the command line are dotted `key=VALUE` pairs applied last; VALUE is parsed as",
        "  YAML: `training.max_steps=10`, `training.report_to=[]`,",
        "  `custom.extra.rollout_matching.vllm.server.base_url=[http://a:8000,http://b:8000]`.",
        "- `rollout:` at the top level is the short form of `custom.extra.rollout_matching` (the spec's",
        "  spelling, which stays valid and is the one listed below): `rollout: {rollout_backend: vllm,",
        "  vllm: {mode: server}}`, or the override `rollout.max_new_tokens=256`. One file (or the overrides)",
        "  may use only one of the two spellings; messages name keys as the config wrote them.",
        "- `rollmatch check-config FILE [key=VALUE ...] [--json] [--world-size N]` resolves the run as",
        "  `rollmatch train` does, through the same function (every rule below, for the learner's world",
        "  size: `--world-size`, `WORLD_SIZE`, or what `launch:` gives a server-mode config, else 1), prints",
        "  the fully resolved config (all defaults filled in) and exits 0, or prints every problem to",
        "  stderr and exits 2.",
        "- From Python: `rollmatch.config.load_config(path, overrides)` or `load_config_dict(mapping)` (keys",
        "  and values), then `rollmatch.config.resolve_run(cfg, world_size=..., device_count=...,",
        "  device_type=...)`, the one way to a run (every rule).",
        "",
    ]


def _rules_section() -> list[str]:
    lines = [
        "## Fail-fast rules",
        "",
        "Keys and values are checked whenever a config is loaded; the rules when the run is resolved",
        "(`check-config`, `train`, `eval`, `launch`):",
        "",
        '- Unknown keys anywhere ("unknown key; did you mean ...?"); duplicate keys in a YAML file.',
    ]
    lines += [f"- `{key}`: {fix}." for key, fix in REJECTED_KEYS.items()]
    lines += [
        f"- `{old}` is still read as `{new}` (with a DeprecationWarning); setting both is an error."
        for old, new in ALIASED_SECTIONS.items()
    ]
    lines += [f"- {text}" for text in rule_descriptions()]
    lines += ["", "Checked with the world size and devices of the launch (same door):", ""]
    lines += [f"- {text}" for text in RUNTIME_RULE_DESCRIPTIONS]
    return [*lines, ""]


if __name__ == "__main__":
    main()
