"""Reading a config: YAML files chained by ``extends:``, dotted overrides, one error listing every problem.

Owns: :func:`load_config` / :func:`load_config_dict` (layers -> short ``rollout:`` spelling ->
legacy translation -> deep merge -> pydantic), the pydantic-error-to-:class:`~rollmatch.errors.ConfigProblem`
conversion (with "did you mean" for unknown keys) and the ``rollmatch check-config`` command, which
resolves the run through the door ``train`` uses (``config.resolved.resolve_run``). Leaves out: the
keys and defaults (``config.schema``), moved / removed keys (``config.legacy``) and cross-field
rules (``config.rules``): a loaded config has valid keys and values; its rules run once, when the
run is resolved (a config with field errors also gets the static rules' problems, so one report
lists every problem).

Merge semantics: ``extends: base.yaml`` (or a list, merged in order) is resolved relative to the
extending file, and so are the input paths a file sets (``config.input_files.INPUT_PATH_KEYS``:
model, data files, DeepSpeed config; an override's relative path stays relative to the working
directory); mappings merge key by key, everything else (lists included) is replaced by the later
layer. Overrides ``a.b.c=VALUE`` form the last layer; VALUE is parsed as YAML (``10``, ``[]``,
``[http://a,http://b]``, ``null``).
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import os
import re
import sys
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from rollmatch.config.frames import describe_coord_frame
from rollmatch.config.input_files import anchor_input_paths
from rollmatch.config.launch_rules import launch_world_size
from rollmatch.config.legacy import aliased_section_conflicts, translate_legacy
from rollmatch.config.resolved import Launch, ResolvedRun, resolve_run, this_launch
from rollmatch.config.resume import resolve_resume
from rollmatch.config.rules import check_config
from rollmatch.config.schema import RollmatchConfig
from rollmatch.config.spelling import Spelling, expand_short_rollout, remember_spelling
from rollmatch.config.trl_names import translate_trl_names
from rollmatch.errors import ConfigError, ConfigProblem

_OVERRIDE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
Layer = tuple[str, dict[str, Any]]  # (source name for messages, raw mapping)


# ------------------------------------------------------------------------------------ public entry
def load_config(
    path: str | Path | None, overrides: Sequence[str] = (), *, under: Sequence[Layer] = ()
) -> RollmatchConfig:
    """Load a YAML config (following ``extends:``), apply ``key=value`` overrides and validate.

    ``path=None`` starts from the schema defaults. ``under``: layers below the file, e.g. a model's
    saved run settings (``config.run_file``), which the file's keys override. Raises one
    :class:`ConfigError` listing every problem: unreadable files and ``extends`` cycles, bad
    overrides, legacy keys and pydantic field errors (with the static rules' problems when there are
    field errors; otherwise the rules run when the run is resolved, ``config.resolved.resolve_run``).
    """
    layers = read_config_layers(Path(path)) if path is not None else []
    return _load_layers([*under, *layers], overrides)


def load_config_dict(
    data: Mapping[str, Any], overrides: Sequence[str] = (), *, source: str = "<dict>"
) -> RollmatchConfig:
    """Validate an in-memory config mapping (``extends`` is not allowed here) plus overrides."""
    if not isinstance(data, Mapping):
        raise ConfigError(
            [ConfigProblem("config", data, "a config is a mapping of sections (model, data, ...)")]
        )
    if "extends" in data:
        raise ConfigError(
            [
                ConfigProblem(
                    "extends", data["extends"], "`extends` needs a file to resolve against; use load_config"
                )
            ]
        )
    return _load_layers([(source, copy.deepcopy(dict(data)))], overrides)


def config_to_yaml(cfg: RollmatchConfig) -> str:
    """The fully resolved config (every default filled in) as YAML that loads back to ``cfg``."""
    return yaml.safe_dump(
        _plain(cfg), sort_keys=False, default_flow_style=False, allow_unicode=True, width=100
    )


def config_to_json(cfg: RollmatchConfig) -> str:
    """The fully resolved config as indented JSON."""
    return json.dumps(_plain(cfg), indent=2)


def check_config_command(
    args: argparse.Namespace, input_checks: Callable[[RollmatchConfig], list[ConfigProblem]] | None = None
) -> int:
    """``rollmatch check-config FILE [overrides...] [--json] [--world-size N]``: print the resolved
    config, or every problem.

    The run is resolved through the door ``rollmatch train`` takes (:func:`resolve_run`, every rule
    of the config) for the learner's world size (:func:`check_world_size`) on this machine's devices, with the trainer's resume rule; ``input_checks`` adds the checks of the run's
    inputs (``data.input_checks``: files, record lengths), reported with the rest. Without them
    (``--schema-only``) ``data.coord_frame: auto`` stays unresolved while ``model.path`` has no
    ``config.json``.

    Exit 0 with the config on stdout and the resolved ``data.coord_frame`` (``resolved: ...``) on
    stderr; ``--json`` adds a top-level ``resolved`` object (not a config key): the run's values
    in force (:meth:`ResolvedRun.as_dict`: coordinate frame, sync mode, servers, pixel bounds,
    gradient accumulation steps, decode batch, decodings) and ``resume_from``. Exit 2 with every
    problem (key, value, fix) on stderr. Deprecation warnings go to stderr in both cases.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        try:
            cfg = load_config(args.config, args.overrides)
        except ConfigError as exc:
            _print_warnings(caught)
            _print_problems(args.config, exc)
            return 2
    _print_warnings(caught)
    try:
        world_size = check_world_size(cfg, getattr(args, "world_size", None))
        launch = this_launch(world_size, without_torch=input_checks is None)  # --schema-only: no torch
        run, resume_from = resolve_checked_run(
            cfg, launch, resume_world_size=world_size, input_checks=input_checks
        )
        frame = describe_coord_frame(cfg.data.coord_frame, cfg.model.path, cfg.custom.object_format)
    except ConfigError as exc:
        _print_problems(args.config, exc)
        return 2
    if getattr(args, "json", False):
        print(json.dumps(resolved_json(cfg, run, resume_from), indent=2))
    else:
        print(config_to_yaml(cfg), end="")
    print(f"resolved: {frame}", file=sys.stderr)
    print(f"resolved: training starts from {resume_from or 'step 0'}", file=sys.stderr)
    return 0


def check_world_size(cfg: RollmatchConfig, flag: int | None) -> int | None:
    """The learner world size ``check-config`` resolves for: ``--world-size``, else torchrun's
    ``WORLD_SIZE``, else what ``rollmatch launch`` gives the config (``launch.learner_devices`` per
    learner node; :func:`~rollmatch.config.launch_rules.launch_world_size`), else None (one process)."""
    if flag is not None:
        return flag
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return launch_world_size(cfg)


def resolve_checked_run(
    cfg: RollmatchConfig,
    launch: Launch,
    *,
    resume_world_size: int | None,
    input_checks: Callable[[RollmatchConfig], list[ConfigProblem]] | None = None,
) -> tuple[ResolvedRun, str | None]:
    """The run ``rollmatch train`` starts for ``launch`` and the checkpoint it resumes from: every input
    problem (``input_checks``), the resume rule's (a checkpoint saved by another world size than
    ``resume_world_size`` refused; None: not checked) and every rule's, raised as one :class:`ConfigError`.
    ``check-config`` and ``train`` both resolve through here."""
    problems = list(input_checks(cfg)) if input_checks is not None else []
    resume_from = None
    try:  # the trainer's rule, on this machine's output_dir
        resume_from = resolve_resume(
            cfg.training.resume_from_checkpoint,
            cfg.training.output_dir,
            resume_world_size,
            overwrite=cfg.training.overwrite_output_dir,
        )
    except ConfigError as error:
        problems.extend(error.problems)
    run = resolve_run(
        cfg,
        world_size=launch.world_size,
        device_count=launch.device_count,
        device_type=launch.device_type,
        problems=problems,
        model_required=input_checks is not None,
    )
    return run, resume_from


def resolved_json(
    cfg: RollmatchConfig, run: ResolvedRun | None = None, resume_from: str | None = None
) -> dict[str, Any]:
    """What ``check-config --json`` prints: the config with every default, and ``resolved``
    (:meth:`ResolvedRun.as_dict` and ``resume_from``). ``run`` None: ``cfg`` resolved as
    ``check-config --schema-only`` does on a CPU machine (:func:`check_world_size`, no checkpoint needed)."""
    if run is None:
        world_size = check_world_size(cfg, None) or 1
        run = resolve_run(cfg, world_size=world_size, device_count=0, device_type="cpu", model_required=False)
    return {**_plain(cfg), "resolved": {**run.as_dict(), "resume_from": resume_from}}


# ------------------------------------------------------------------------------------------- files
def read_config_layers(path: Path, _chain: tuple[Path, ...] = ()) -> list[Layer]:
    """The layers of ``path`` base-first: every ``extends`` ancestor, then the file itself."""
    resolved = path.expanduser().resolve()
    if resolved in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, resolved))
        raise ConfigError([ConfigProblem("extends", str(path), f"extends cycle: {cycle}; remove one link")])
    if not resolved.is_file():
        raise ConfigError([ConfigProblem("config file", str(path), f"file not found: {resolved}")])
    data = _read_yaml_mapping(resolved)
    layers: list[Layer] = []
    for base in _extends_list(data.pop("extends", None), resolved):
        base_path = resolved.parent / Path(base).expanduser()
        if not base_path.is_file():
            raise ConfigError(
                [
                    ConfigProblem(
                        "extends", base, f"file not found: {base_path.resolve()} (extended by {resolved})"
                    )
                ]
            )
        layers.extend(read_config_layers(base_path, (*_chain, resolved)))
    layers.append((str(resolved), anchor_input_paths(data, resolved.parent)))
    return layers


def parse_overrides(overrides: Sequence[str]) -> tuple[dict[str, Any], list[ConfigProblem]]:
    """``["a.b=1", "c=[x,y]"]`` -> ``{"a": {"b": 1}, "c": ["x", "y"]}``; later overrides win."""
    layer: dict[str, Any] = {}
    problems: list[ConfigProblem] = []
    for text in overrides:
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep or not _OVERRIDE_KEY.match(key):
            problems.append(
                ConfigProblem(
                    key or text, text, "an override is dotted.key=VALUE, e.g. training.max_steps=10"
                )
            )
            continue
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            problems.append(ConfigProblem(key, raw, f"override value is not valid YAML ({exc}); quote it"))
            continue
        node = layer
        *parents, leaf = key.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}  # a later, deeper override replaces an earlier scalar
            node = node[part]
        node[leaf] = value
    return layer, problems


def deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``: mappings merge recursively; lists, scalars and null replace."""
    merged = copy.deepcopy(dict(base))
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


# ------------------------------------------------------------------------------------ private helpers
def _load_layers(layers: list[Layer], overrides: Sequence[str]) -> RollmatchConfig:
    override_layer, problems = parse_overrides(overrides)
    all_layers: list[Layer] = []
    short = long = False
    for source, raw in [*layers, ("<overrides>", override_layer)]:
        expanded, short_problems, layer_short, layer_long = expand_short_rollout(raw, source)
        problems.extend(short_problems)
        short, long = short or layer_short, long or layer_long
        all_layers.append((source, expanded))
    spelling = Spelling(short_rollout=short and not long, overrides=tuple(overrides))
    problems.extend(aliased_section_conflicts(all_layers))
    merged: dict[str, Any] = {}
    for source, layer in all_layers:
        translated, legacy_problems = translate_legacy(layer, source)
        problems.extend(legacy_problems)
        translated, trl_problems = translate_trl_names(translated, source)
        problems.extend(trl_problems)
        merged = deep_merge(merged, translated)

    cfg, field_problems = _validate(merged)
    problems.extend(field_problems)
    if cfg is not None and problems:  # report the rules' problems with the fields', all at once
        reported = {p.key for p in field_problems}
        problems.extend(p for p in check_config(cfg) if p.key not in reported)
    if problems:
        raise ConfigError(spelling.as_written(problems))
    assert cfg is not None
    return remember_spelling(cfg, spelling)


def _validate(merged: dict[str, Any]) -> tuple[RollmatchConfig | None, list[ConfigProblem]]:
    """Validate; on field errors also validate without the bad keys, so rules still run on the rest."""
    try:
        return RollmatchConfig.model_validate(merged), []
    except ValidationError as exc:
        problems, bad_paths = _problems_from_validation(exc)
    try:
        return RollmatchConfig.model_validate(_strip_paths(merged, bad_paths)), problems
    except ValidationError:
        return None, problems


@dataclass
class _Location:
    """Where a pydantic error points in the schema: dotted key, owning section, field, strip path."""

    key: str
    section: type[BaseModel]
    field: FieldInfo | None  # None: the key is not in the schema
    strip: tuple[str | int, ...]  # mapping path to delete so the rest of the config validates


def _problems_from_validation(
    exc: ValidationError,
) -> tuple[list[ConfigProblem], list[tuple[str | int, ...]]]:
    """One problem per dotted key (union members merged) and the paths to strip for a second pass."""
    grouped: dict[str, tuple[_Location, Any, list[str]]] = {}
    for error in exc.errors(include_url=False):
        where = _locate(error["loc"], missing=error["type"] == "missing")
        message = _error_message(error, where)
        if where.key not in grouped:
            value = None if error["type"] == "missing" else error["input"]
            grouped[where.key] = (where, value, [])
        if message not in grouped[where.key][2]:
            grouped[where.key][2].append(message)
    problems = [
        ConfigProblem(key, value, "; or ".join(messages)) for key, (_, value, messages) in grouped.items()
    ]
    return problems, [where.strip for where, _, _ in grouped.values() if where.strip]


def _locate(loc: tuple[str | int, ...], *, missing: bool) -> _Location:
    """Walk ``loc`` through the schema. Union-member tags (``'list[str]'``) are skipped; list indices
    become ``[i]``. The strip path stops at the first key that holds a non-section value, so deleting
    it resets a whole list or scalar to its default instead of breaking a list item."""
    from rollmatch.config import docs as schema_docs  # lazy: docs is also a `python -m` entry point

    annotation: Any = RollmatchConfig
    section: type[BaseModel] = RollmatchConfig
    parts: list[str] = []
    field: FieldInfo | None = None
    named: list[tuple[str | int, ...]] = []
    frozen = False
    for i, elem in enumerate(loc):
        model = schema_docs.section_class(annotation)
        if model is not None:  # inside a section every loc element is a mapping key (YAML allows `1:`)
            section, parts = model, [*parts, str(elem)]
            field = schema_docs.section_fields(model).get(str(elem))
            if not frozen:
                named.append(tuple(loc[: i + 1]))
            if field is None:
                break
            annotation = field.annotation
            frozen = frozen or schema_docs.section_class(annotation) is None
        elif isinstance(elem, int) and parts:
            parts[-1] += f"[{elem}]"
            annotation = _list_item(annotation)
    if missing and not frozen:
        named = named[:-1]  # a missing key cannot be deleted: reset its section instead
    return _Location(".".join(parts), section, field, named[-1] if named else ())


def _error_message(error: Mapping[str, Any], where: _Location) -> str:
    from rollmatch.config import docs as schema_docs

    if error["type"] == "extra_forbidden":
        return f"unknown key; {_suggestion(where)}"
    described = f" ({where.field.description})" if where.field is not None and where.field.description else ""
    if error["type"] == "missing":
        return f"required key is missing{described}"
    expected = (
        f"; expected {schema_docs.type_name(where.field.annotation)}" if where.field is not None else ""
    )
    return f"{error['msg']}{expected}{described}"


def _suggestion(where: _Location) -> str:
    from rollmatch.config import docs as schema_docs

    parent, _, name = where.key.rpartition(".")
    name = name.split("[")[0]
    known = list(schema_docs.section_fields(where.section))
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if close:
        return f"did you mean {parent + '.' if parent else ''}{close[0]}?"
    # The right key in the wrong section, e.g. a top-level `max_steps`.
    elsewhere = [f.path for f in schema_docs.iter_schema_fields() if f.path.rpartition(".")[2] == name]
    if elsewhere:
        return f"did you mean {' or '.join(elsewhere)}?"
    return f"valid keys here: {', '.join(known)}"


def _list_item(annotation: Any) -> Any:
    for candidate in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(candidate) is list:
            return typing.get_args(candidate)[0]
    return None


def _strip_paths(data: dict[str, Any], paths: list[tuple[str | int, ...]]) -> dict[str, Any]:
    stripped = copy.deepcopy(data)
    for path in paths:
        node: Any = stripped
        for elem in path[:-1]:
            if isinstance(node, dict):
                node = node.get(elem)
            elif isinstance(node, list) and isinstance(elem, int) and elem < len(node):
                node = node[elem]
            else:
                node = None
        if isinstance(node, dict):
            node.pop(path[-1], None)
    return stripped


def _read_yaml_mapping(path: Path) -> dict[str, Any]:
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(
            [ConfigProblem("config file", str(path), f"not valid YAML: {str(exc)[:500]}")]
        ) from exc
    if data is None:
        raise ConfigError(
            [
                ConfigProblem(
                    "config file", str(path), "the file is empty; a config needs at least `model.path`"
                )
            ]
        )
    if not isinstance(data, dict):
        raise ConfigError(
            [
                ConfigProblem(
                    "config file",
                    str(path),
                    f"top level must be a mapping of sections, got {type(data).__name__}",
                )
            ]
        )
    return data


def _extends_list(value: Any, path: Path) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ConfigError(
        [
            ConfigProblem(
                "extends",
                value,
                f"in {path}: extends is a file path or a list of paths (relative to this file)",
            )
        ]
    )


def _plain(cfg: RollmatchConfig) -> dict[str, Any]:
    return cfg.model_dump(mode="json", by_alias=True)


def _print_problems(source: Any, exc: ConfigError) -> None:
    print(f"{source}: invalid config ({len(exc.problems)} problem(s)):", file=sys.stderr)
    for problem in exc.problems:
        print(f"  - {problem.key} = {problem.shown_value}\n      fix: {problem.fix}", file=sys.stderr)


def _print_warnings(caught: list[warnings.WarningMessage]) -> None:
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (YAML silently keeps the last one)."""


def _construct_unique_mapping(
    loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False
) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while reading a mapping", node.start_mark, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)
