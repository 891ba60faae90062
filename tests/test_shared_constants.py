"""Names that cross module boundaries (credential headers and variables, Qwen-VL's image token) are
defined once: a second module-level definition of the same text is a copy that can drift."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rollmatch"
SHARED = {
    "ROLLMATCH_API_KEY": "rollmatch/protocol/auth.py",
    "ROLLMATCH_SYNC_KEY": "rollmatch/protocol/auth.py",
    "X-Rollmatch-Sync-Key": "rollmatch/protocol/auth.py",
    "X-Rollmatch-Sync-Lease": "rollmatch/protocol/auth.py",
    "<|image_pad|>": "rollmatch/data/prompts.py",
}


def test_each_shared_constant_is_defined_once_in_its_module() -> None:
    defined: dict[str, list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            text = _assigned_text(node)
            if text in SHARED:
                defined[text].append(str(path.relative_to(PACKAGE.parent)))
    assert dict(defined) == {text: [module] for text, module in SHARED.items()}


def _assigned_text(node: ast.stmt) -> object:
    """The constant a module-level ``NAME = <constant>`` assigns (``None`` for anything else)."""
    if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Constant):
        return node.value.value
    return None
