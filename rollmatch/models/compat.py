"""Environment workarounds, in one place, each applied only when the environment needs it.

Owns: making a broken ``torchvision`` importable. On CPU-only machines the registry only has
CUDA-linked torchvision wheels: its C ops fail to load and ``import torchvision`` raises in the
fake-kernel registrations (``operator torchvision::nms does not exist``). transformers, peft and
vLLM's Qwen-VL code import torchvision's pure-python transforms, so we let the package load without
its op registrations; ``torchvision.ops``/``io`` stay unusable (nothing here calls them).
Where torchvision is not installed at all, transformers cannot build the Qwen-VL video processor and
its processors refuse to load without one: we drop that slot (rollmatch feeds images only).
Leaves out: vLLM engine settings (``rollmatch.rollout.vllm_engine``).

When: ``import rollmatch`` only installs :func:`apply_workarounds_on_import`, an import hook that
applies them right before the first import of ``torchvision``, ``transformers``, ``peft`` or
``vllm``, so commands that never load a model (``rollmatch --help``, ``check-config``, ``data``)
never pay for importing torch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any

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


_TRIGGERS = ("torchvision", "transformers", "peft", "vllm")


def apply_workarounds_on_import() -> None:
    """Apply :func:`apply_workarounds` right before the first import of a module that needs them
    (at once when one is already imported)."""
    if any(name in sys.modules for name in _TRIGGERS):
        apply_workarounds()
    elif not any(isinstance(finder, _WorkaroundHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WorkaroundHook())


class _WorkaroundHook(importlib.abc.MetaPathFinder):
    """Applies the workarounds when a trigger module is first looked up, then steps aside."""

    def __init__(self) -> None:
        self._probing = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _TRIGGERS or self._probing:
            return None
        if fullname == "torchvision" and "status" not in _state:
            self._uninstall()  # imported first: probe and patch while it loads, as the import itself
            return _spec_with_loader(fullname, path, target, _ProbingLoader)
        self._probing = True  # the probe imports torchvision itself: that lookup passes through
        try:
            status = torchvision_status()
        finally:
            self._probing = False
        if status != "absent" or fullname == "transformers":
            self._uninstall()
        if fullname == "transformers" and status == "absent":
            return _spec_with_loader(fullname, path, target, _ThenDropVideoSlot)
        return None

    def _uninstall(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


class _ProbingLoader(importlib.abc.Loader):
    """torchvision's own loader; a load that fails in its op registrations is retried without them."""

    def __init__(self, loader: Any):
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        try:
            self.loader.exec_module(module)
            _state["status"] = "ok"
        except RuntimeError as exc:
            if "torchvision::" not in str(exc):
                raise
            _stub_op_registrations()
            self.loader.exec_module(module)
            _state["status"] = "patched"

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class _ThenDropVideoSlot(importlib.abc.Loader):
    """transformers' own loader, then the video-slot workaround (it patches transformers itself)."""

    def __init__(self, loader: Any):
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        apply_workarounds()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def _spec_with_loader(
    fullname: str, path: Sequence[str] | None, target: types.ModuleType | None, wrapper: Any
) -> importlib.machinery.ModuleSpec | None:
    """The spec the other finders give ``fullname``, its loader wrapped in ``wrapper``."""
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        spec = find_spec(fullname, path, target) if find_spec is not None else None
        if spec is not None:
            if spec.loader is not None:
                spec.loader = wrapper(spec.loader)
            return spec
    return None


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
    sys.modules.pop("torchvision", None)
    _stub_op_registrations()
    importlib.import_module("torchvision")
    return "patched"


def _stub_op_registrations() -> None:
    # The failed import left half-initialised submodules behind: drop them and stub the op
    # registrations (they only register kernels for ops that failed to load) before importing again.
    for name in [m for m in sys.modules if m.startswith("torchvision.")]:
        del sys.modules[name]
    for name in _OP_REGISTRATION_MODULES:
        sys.modules[name] = types.ModuleType(name)
