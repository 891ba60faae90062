"""Environment workarounds: broken torchvision ("patched"/"ok") and absent torchvision ("absent").

Each case runs in a fresh interpreter, because the workaround changes import state for good.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is None, reason="torchvision not installed"
)


def _run(code: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
    )


def test_installed_torchvision_is_used_or_patched() -> None:
    bare = _run("import torchvision")
    expected = "ok" if bare.returncode == 0 else "patched"
    if expected == "patched":
        assert "torchvision::" in bare.stderr, bare.stderr[-2000:]
    result = _run(
        """
        import rollmatch
        from rollmatch.models.compat import torchvision_status
        import torchvision.transforms.functional  # what transformers / vLLM's Qwen-VL code import
        from transformers import AutoProcessor, Qwen2VLVideoProcessor
        print(torchvision_status())
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [expected]


def test_absent_torchvision_drops_the_video_slot(tmp_path: Path) -> None:
    # sys.modules[name] = None makes the module absent for both import and importlib.util.find_spec.
    result = _run(
        f"""
        import sys
        sys.modules["torchvision"] = None
        import rollmatch
        from rollmatch.models.compat import torchvision_status
        from rollmatch.models.tiny import build_tiny_model
        from PIL import Image
        from transformers import AutoProcessor
        out = build_tiny_model("qwen2_5_vl", {str(tmp_path / "model")!r})
        processor = AutoProcessor.from_pretrained(out)
        text = processor.apply_chat_template(
            [{{"role": "user", "content": [{{"type": "image"}}, {{"type": "text", "text": "Find."}}]}}],
            add_generation_prompt=True, tokenize=False)
        batch = processor(text=[text], images=[Image.new("RGB", (224, 224))], return_tensors="pt")
        print(torchvision_status(), type(processor.image_processor).__name__,
              hasattr(processor, "video_processor"), sorted(batch.keys()))
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    status, image_processor, has_video, *keys = result.stdout.split(maxsplit=3)
    assert (status, image_processor, has_video) == ("absent", "Qwen2VLImageProcessorPil", "False")
    assert "mm_token_type_ids" in keys[0] and "image_grid_thw" in keys[0]


def test_unrelated_import_failure_is_not_swallowed() -> None:
    # Fault injection: a torchvision whose import fails for a reason the workaround does not cover.
    result = _run(
        """
        import importlib.abc, importlib.machinery, sys

        class BrokenLoader(importlib.abc.Loader):
            def create_module(self, spec):
                return None
            def exec_module(self, module):
                raise RuntimeError("CUDA driver initialization failed")

        class BrokenFinder(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "torchvision":
                    return importlib.machinery.ModuleSpec(name, BrokenLoader())
                return None

        sys.meta_path.insert(0, BrokenFinder())
        import rollmatch  # light: the workarounds run when transformers first loads
        import transformers
        """
    )
    assert result.returncode != 0
    assert "CUDA driver initialization failed" in result.stderr
