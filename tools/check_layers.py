"""Import-layer and import-circle check of the ``rollmatch`` package (``make lint``, tests/test_layers.py).

Every top-level part of the package (``rollmatch/<name>.py`` or ``rollmatch/<name>/``) sits in one
layer; a module may import from its own layer and the layers below it, never from above. Every
``import`` counts: module level, inside functions (lazy imports) and under ``TYPE_CHECKING``, since
each one is a dependency a reader has to follow. Shared pieces move below their users instead of
being imported upwards. Within a layer, modules must not import each other in a circle (``a``
imports ``b`` imports ... ``a``), counted over the same imports: a circle means neither module can
be read or tested without the other; the shared piece moves into a module both import.

Beside the package, the repository's programs (:func:`check_programs`): ``studies/`` (the study
drivers, a package) and ``bench/`` (the performance benches) sit above every layer. They import
``rollmatch``; ``rollmatch`` never imports them, no bench imports a study (a helper two of them need
moves into ``rollmatch`` or stays in its folder), no study imports a bench, and the modules of
``studies/`` import each other in no circle.

Usage: ``python tools/check_layers.py [PACKAGE_DIR]`` (default: ``rollmatch`` beside this folder, and the
programs beside it); prints one line per violation or circle and exits 1, or exits 0 silently.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

# Lowest first. A new top-level module must be placed here deliberately.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("config", "collectives"),
    ("__init__", "models", "detection", "packing"),  # __init__: the package root applies models.compat
    ("data",),
    ("protocol",),  # wire models: below both of their users, the client (rollout) and the server
    ("rollout", "sync"),
    ("server",),
    ("viz",),  # pictures of records and predictions, drawn by eval and the demo
    ("evaluation", "diagnostics"),  # below training, so training may evaluate (never the other way round)
    ("training",),
    ("demo", "launch", "cli", "api"),  # entry points
)
LAYER_OF = {part: index for index, parts in enumerate(LAYERS) for part in parts}


@dataclass(frozen=True)
class Violation:
    path: Path
    line: int
    importer: str
    imported: str

    def __str__(self) -> str:
        if self.importer not in LAYER_OF:
            return (
                f"{self.path}: rollmatch.{self.importer} is in no layer; add it to LAYERS in "
                "tools/check_layers.py"
            )
        below = ", ".join(part for parts in LAYERS[: LAYER_OF[self.importer] + 1] for part in parts)
        return (
            f"{self.path}:{self.line}: {self.importer} (layer {LAYER_OF[self.importer]}) imports "
            f"rollmatch.{self.imported} (layer {LAYER_OF.get(self.imported, '?')}); it may import only "
            f"from: {below}. Move the shared piece below both users."
        )


def check_package(package_dir: Path) -> list[Violation]:
    """Every import in ``package_dir`` that reaches a higher layer (or a part in no layer)."""
    violations: list[Violation] = []
    for path in sorted(package_dir.rglob("*.py")):
        importer = _top_part(path.relative_to(package_dir))
        if importer not in LAYER_OF:
            violations.append(Violation(path, 1, importer, importer))
            continue
        for line, module in _rollmatch_imports(path):
            imported = module.split(".")[1] if "." in module else "__init__"
            if LAYER_OF.get(imported, len(LAYERS)) > LAYER_OF[importer]:
                violations.append(Violation(path, line, importer, imported))
    return violations


def find_import_circles(package_dir: Path) -> list[list[str]]:
    """Every import circle among the modules of ``package_dir``, each as its sorted module names.

    ``from rollmatch.a import b`` depends on ``rollmatch.a.b`` when that is a module, else on
    ``rollmatch.a``; a module's own package ``__init__`` is not counted as imported by it.
    """
    root = package_dir.name
    modules: dict[str, Path] = {}
    for path in package_dir.rglob("*.py"):
        parts = (root, *path.relative_to(package_dir).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {_owning_module(module, modules) for module in _imported_modules(path, root)}
        graph[name] = {target for target in targets if target is not None and target != name}
    return sorted(sorted(circle) for circle in _strongly_connected(graph) if len(circle) > 1)


# Folders beside the package that hold programs, and the top-level names each must not import.
PROGRAMS: dict[str, tuple[str, ...]] = {"studies": ("bench",), "bench": ("studies",)}


def check_programs(repo: Path) -> list[str]:
    """Imports across the package and the program folders of ``repo`` that go the wrong way: the package
    importing a program folder, a bench importing a study or a study a bench; and circles in studies/."""
    forbidden = {"rollmatch": tuple(PROGRAMS), **PROGRAMS}
    found: list[str] = []
    for folder, refused in forbidden.items():
        for path in sorted((repo / folder).rglob("*.py")):
            for line, module in _top_level_imports(path):
                if module in refused:
                    found.append(
                        f"{path}:{line}: {folder} imports {module}; {folder} may not import {', '.join(refused)}. "
                        "Move the shared piece into rollmatch (or into the importer's own folder)."
                    )
    if (repo / "studies").is_dir():
        found.extend(
            f"import circle: {' <-> '.join(circle)}; move the shared piece into a module both import"
            for circle in find_import_circles(repo / "studies")
        )
    return found


def _top_level_imports(path: Path) -> list[tuple[int, str]]:
    """(line, first name) of every absolute import in ``path``, lazy and TYPE_CHECKING ones included."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name.split(".")[0]) for alias in node.names)
    return found


def _top_part(relative: Path) -> str:
    """``errors.py`` -> errors, ``config/load.py`` -> config, the package's ``__init__.py`` -> __init__."""
    return "__init__" if relative == Path("__init__.py") else relative.parts[0].removesuffix(".py")


def _rollmatch_imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
            if node.module == "rollmatch":  # `from rollmatch import x`: x is the part imported
                modules = [f"rollmatch.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        found.extend((node.lineno, m) for m in modules if m == "rollmatch" or m.startswith("rollmatch."))
    return found


def _imported_modules(path: Path, root: str) -> list[str]:
    """Each name an import in ``path`` may refer to: ``from a import b`` gives ``a.b`` (maybe a module)."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.extend(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
    return [name for name in found if name == root or name.startswith(f"{root}.")]


def _owning_module(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iterative (no recursion limit on deep chains)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, ())))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(component)
    return components


def main(argv: list[str]) -> int:
    package_dir = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "rollmatch"
    violations = check_package(package_dir)
    for violation in violations:
        print(violation)
    circles = find_import_circles(package_dir)
    for circle in circles:
        print(f"import circle: {' <-> '.join(circle)}; move the shared piece into a module both import")
    programs = [] if argv else check_programs(package_dir.parent)
    for problem in programs:
        print(problem)
    return 1 if violations or circles or programs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
