"""What a weight sync sends: merged or adapter tensors, packed into flat buckets.

Owns: :func:`iter_sync_tensors` (the tensors a rollout engine needs, under the names vLLM loads)
and :class:`Bucket` / :func:`flatten_buckets` / :func:`unflatten_bucket` (byte-exact packing of many
tensors into few flat buffers). Leaves out: the checksum both sides of a sync compute (one scheme,
per bucket: ``rollmatch.sync.transaction.bucket_checksum``), moving buckets between processes
(``rollmatch.sync.transport``) and loading them into an engine (``rollmatch.rollout.vllm_engine``,
``rollmatch.server``).

Names. ``full`` yields Hugging Face ``state_dict`` names of the unwrapped model
(``model.visual.*``, ``model.language_model.*``, ``lm_head.weight``); vLLM's Qwen2-VL, Qwen2.5-VL
and Qwen3-VL loaders map exactly these (``hf_to_vllm_mapper``). With tied embeddings
``lm_head.weight`` is the embedding tensor and is not yielded (vLLM ties it itself). ``adapter``
yields the PEFT checkpoint names vLLM's LoRA loader parses (``parse_fine_tuned_lora_name``):
``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight`` (adapter name removed), exactly
what ``peft.get_peft_model_state_dict`` saves.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from rollmatch.errors import SyncError
from rollmatch.models.wrappers import strip_parallel_wrappers

SyncMode = Literal["full", "adapter"]

_PEFT_PREFIX = "base_model.model."
_BUCKET_ALIGN_BYTES = 16  # every tensor starts 16-byte aligned so any dtype can view its slice


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives in a bucket: ``offset`` is in bytes from the start of ``flat``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * _dtype_from_name(self.dtype).itemsize


@dataclass
class Bucket:
    """Several tensors' bytes in one flat ``uint8`` buffer (on the tensors' device)."""

    metas: list[TensorMeta]
    flat: torch.Tensor

    @property
    def num_bytes(self) -> int:
        return int(self.flat.numel())


def is_peft_model(model: nn.Module) -> bool:
    """True for a ``peft.PeftModel`` (after unwrapping)."""
    return (
        hasattr(model, "peft_config") and hasattr(model, "base_model") and hasattr(model, "active_adapters")
    )


def iter_sync_tensors(model: nn.Module, mode: SyncMode) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` pairs a rollout engine needs to serve ``model``'s current weights.

    ``full``: merged weights. LoRA/DoRA layers are merged one at a time with PEFT's own ``merge``
    into the base weight, the merged tensor is copied out, and the base weight is restored from a
    saved copy (exact, unlike ``unmerge``'s subtraction, which drifts in bf16); the restore runs in
    ``finally``, so the model is unchanged even if the consumer raises or stops early. ``adapter``:
    only LoRA A/B tensors (see the module docstring for names). Yielded tensors are detached; in
    ``full`` mode non-adapter tensors are the model's own storage (copy them if you keep them
    across optimizer steps).
    """
    inner = strip_parallel_wrappers(model)
    _reject_partitioned_parameters(inner)
    if mode == "adapter":
        yield from _iter_adapter_tensors(inner)
    elif mode == "full":
        yield from _iter_full_tensors(inner)
    else:
        raise SyncError(f"sync mode {mode!r} is not one of 'full', 'adapter'")


def peft_adapter_config(model: nn.Module) -> dict[str, Any]:
    """The active adapter's PEFT config as the ``adapter_config.json`` dict vLLM reads."""
    inner = strip_parallel_wrappers(model)
    if not is_peft_model(inner):
        raise SyncError(
            f"adapter sync needs a PEFT model, got {type(inner).__name__}: enable `model.lora.enabled` "
            "or set `custom.extra.rollout_matching.vllm.sync.mode: full`"
        )
    adapter = _single_active_adapter(inner)
    config = inner.peft_config[adapter].to_dict()
    config["target_modules"] = sorted(config["target_modules"]) if config.get("target_modules") else None
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}


def flatten_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = 64 << 20
) -> Iterator[Bucket]:
    """Pack tensors into ``uint8`` buckets of at most ``bucket_bytes`` (a bigger tensor gets its own).

    Every tensor is copied (so the bucket stays valid after the source changes) at a 16-byte
    aligned offset; order is preserved across and within buckets.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    pending: list[tuple[str, torch.Tensor]] = []
    used = 0
    for name, tensor in named:
        size = _aligned(tensor.numel() * tensor.element_size())
        if pending and used + size > bucket_bytes:
            yield _pack(pending)
            pending, used = [], 0
        pending.append((name, tensor.detach()))
        used += size
    if pending:
        yield _pack(pending)


def unflatten_bucket(
    bucket_metas: Iterable[TensorMeta], flat: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of a bucket; tensors are views sharing ``flat``'s memory."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise SyncError(
            f"a bucket's flat buffer must be 1-D uint8, got {flat.dtype} with shape {tuple(flat.shape)}"
        )
    out: list[tuple[str, torch.Tensor]] = []
    for meta in bucket_metas:
        end = meta.offset + meta.nbytes
        if end > flat.numel():
            raise SyncError(
                f"bucket metadata of {meta.name!r} ends at byte {end} but the buffer has {flat.numel()} bytes: "
                "sender and receiver disagree on the bucket layout"
            )
        view = flat[meta.offset : end].view(_dtype_from_name(meta.dtype)).view(meta.shape)
        out.append((meta.name, view))
    return out


# ------------------------------------------------------------------------------------------ helpers
def _iter_full_tensors(inner: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    peft = is_peft_model(inner)
    base = inner.base_model.model if peft else inner
    tuner_layers = _tuner_layers(base) if peft else {}
    adapter = _single_active_adapter(inner) if peft else ""
    state = base.state_dict(keep_vars=False)
    yielded_storage: set[int] = set()
    merged: dict[str, torch.Tensor] = {}
    merged_layer = ""
    for key, tensor in state.items():
        name = _full_name(key, adapter)
        if name is None:
            continue
        layer_prefix = key.split(".base_layer.", 1)[0] if ".base_layer." in key else ""
        if layer_prefix in tuner_layers and _needs_merge(tuner_layers[layer_prefix]):
            if layer_prefix != merged_layer:
                merged, merged_layer = _merged_base_tensors(tuner_layers[layer_prefix]), layer_prefix
            tensor = merged[key.rsplit(".", 1)[1]]
        if name.startswith("lm_head.") and tensor.data_ptr() in yielded_storage:
            continue  # tied to the input embedding: vLLM ties it on its side
        yielded_storage.add(tensor.data_ptr())
        yield name, tensor.detach()


def _iter_adapter_tensors(inner: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    if not is_peft_model(inner):
        raise SyncError(
            f"adapter sync needs a PEFT (LoRA) model, got {type(inner).__name__}: enable `model.lora.enabled` "
            "or set `custom.extra.rollout_matching.vllm.sync.mode: full`"
        )
    adapter = _single_active_adapter(inner)
    if getattr(inner.peft_config[adapter], "use_dora", False):
        raise SyncError(
            "adapter sync cannot send DoRA adapters (vLLM's LoRA loader has no magnitude vectors): set "
            "`custom.extra.rollout_matching.vllm.sync.mode: full`"
        )
    from peft import get_peft_model_state_dict

    for name, tensor in get_peft_model_state_dict(inner, adapter_name=adapter).items():
        if ".lora_" in name:
            yield name, tensor.detach()


def _tuner_layers(base: nn.Module) -> dict[str, nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {name: module for name, module in base.named_modules() if isinstance(module, BaseTunerLayer)}


def _needs_merge(layer: Any) -> bool:
    return not layer.merged and not layer.disable_adapters and bool(layer.active_adapters)


@torch.no_grad()
def _merged_base_tensors(layer: Any) -> dict[str, torch.Tensor]:
    """Merge ``layer``'s active adapters with PEFT's ``merge``, copy the result, restore exactly."""
    base_layer = layer.get_base_layer()
    saved = {name: param.detach().clone() for name, param in base_layer.named_parameters(recurse=False)}
    try:
        layer.merge(safe_merge=False, adapter_names=list(layer.active_adapters))
        return {name: param.detach().clone() for name, param in base_layer.named_parameters(recurse=False)}
    finally:
        for name, param in base_layer.named_parameters(recurse=False):
            param.data.copy_(saved[name])
        layer.merged_adapters.clear()


def _full_name(key: str, adapter: str) -> str | None:
    """HF name of a base-model state_dict key, or None for adapter-only tensors."""
    if ".lora_" in key or ".original_module." in key:
        return None
    if ".modules_to_save." in key:
        head, tail = key.split(".modules_to_save.", 1)
        owner, _, rest = tail.partition(".")
        return f"{head}.{rest}" if owner == adapter else None
    return key.replace(".base_layer.", ".")


def _single_active_adapter(inner: Any) -> str:
    active = list(inner.active_adapters)
    if len(active) != 1:
        raise SyncError(
            f"weight sync supports exactly one active adapter, the model has {active}: call "
            "`model.set_adapter(<name>)` before training"
        )
    return active[0]


def _reject_partitioned_parameters(inner: nn.Module) -> None:
    # ZeRO-3 partitions all parameters or none, so the first one tells.
    name, param = next(iter(inner.named_parameters()), ("", None))
    if param is not None and hasattr(param, "ds_id"):
        raise SyncError(
            f"parameter {name!r} is partitioned by DeepSpeed ZeRO-3; exporting it for a rollout engine "
            "is not supported: use ZeRO stage 2 (`training.deepspeed`), or "
            "`custom.extra.rollout_matching.rollout_backend: hf`"
        )


def _pack(pending: list[tuple[str, torch.Tensor]]) -> Bucket:
    metas: list[TensorMeta] = []
    offset = 0
    for name, tensor in pending:
        metas.append(TensorMeta(name, _dtype_name(tensor.dtype), tuple(tensor.shape), offset, tensor.numel()))
        offset += _aligned(tensor.numel() * tensor.element_size())
    flat = torch.zeros(offset, dtype=torch.uint8, device=pending[0][1].device)
    for meta, (_, tensor) in zip(metas, pending, strict=True):
        flat[meta.offset : meta.offset + meta.nbytes].copy_(_as_bytes(tensor.to(flat.device)))
    return Bucket(metas=metas, flat=flat)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _aligned(nbytes: int) -> int:
    return (nbytes + _BUCKET_ALIGN_BYTES - 1) // _BUCKET_ALIGN_BYTES * _BUCKET_ALIGN_BYTES


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise SyncError(f"unknown tensor dtype {name!r} in bucket metadata")
    return dtype
