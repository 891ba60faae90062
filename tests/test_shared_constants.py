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
            constant = isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Constant)
            if constant and node.value.value in SHARED:  # type: ignore[union-attr]
                defined[node.value.value].append(str(path.relative_to(PACKAGE.parent)))  # type: ignore[union-attr]
    assert dict(defined) == {text: [module] for text, module in SHARED.items()}
