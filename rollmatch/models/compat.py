"""Environment workarounds, in one place, each applied only when the environment needs it.

Owns: making a broken ``torchvision`` importable. On CPU-only machines the registry only has
CUDA-linked torchvision wheels: its C ops fail to load and ``import torchvision`` raises in the
fake-kernel registrations (``operator torchvision::nms does not exist``). transformers, peft and
vLLM's Qwen-VL code import torchvision's pure-python transforms, so we let the package load without
its op registrations; ``torchvision.ops``/``io`` stay unusable (nothing here calls them).
Where torchvision is not installed at all, transformers cannot build the Qwen-VL video processor and
its processors refuse to load without one: we drop that slot (rollmatch feeds images only).
Leaves out: vLLM engine settings (``rollmatch.rollout.vllm_engine``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

_OP_REGISTRATION_MODULES = ("torchvision._meta_registrations", "torchvision._autograd_registrations")
_state: dict[str, str] = {}


def torchvision_status() -> str:
    """``absent``, ``ok`` or ``patched`` (importable only through the workaround); probes once."""
    if "status" not in _state:
        _state["status"] = _probe_and_patch()
    return _state["status"]


def apply_workarounds() -> None:
    """Apply every workaround this environment needs (idempotent, cheap after the first call)."""
    if torchvision_status() == "absent" and "video_slot" not in _state:
        _drop_video_processor_slot()
        _state["video_slot"] = "dropped"


def _drop_video_processor_slot() -> None:
    # ProcessorMixin derives its sub-processor slots from the __init__ signature and then requires
    # every slot to be filled; video processors need torchvision. Without the slot, a Qwen-VL
    # processor loads and processes text + images exactly as before.
    from transformers import processing_utils

    original = processing_utils.ProcessorMixin.get_attributes.__func__

    def get_attributes(cls: type) -> list[str]:
        return [name for name in original(cls) if name != "video_processor"]

    processing_utils.ProcessorMixin.get_attributes = classmethod(get_attributes)


def _probe_and_patch() -> str:
    if importlib.util.find_spec("torchvision") is None:
        return "absent"
    try:
        importlib.import_module("torchvision")
        return "ok"
    except RuntimeError as exc:
        if "torchvision::" not in str(exc):
            raise
    # The failed import left half-initialised modules behind: drop them, stub the op
    # registrations (they only register kernels for ops that failed to load) and import again.
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    for name in _OP_REGISTRATION_MODULES:
        sys.modules[name] = types.ModuleType(name)
    importlib.import_module("torchvision")
    return "patched"
