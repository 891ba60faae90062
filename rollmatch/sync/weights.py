"""What a weight sync sends: merged or adapter tensors, packed into flat buckets.

Owns: :func:`iter_sync_tensors` (the tensors a rollout engine needs, under the names vLLM loads)
and :class:`Bucket` / :func:`flatten_buckets` / :func:`unflatten_bucket` (byte-exact packing of many
tensors into few flat buffers). Leaves out: the checksum both sides of a sync compute (one scheme,
per bucket: ``rollmatch.sync.transaction.bucket_checksum``), moving buckets between processes
(``rollmatch.sync.transport``) and loading them into an engine (``rollmatch.rollout.vllm_engine``,
``rollmatch.server``).

Sharded parameters. Under DeepSpeed ZeRO-3 or FSDP2 each rank holds a shard of every parameter. A
full export then gathers the parameters **per bucket** (:class:`ParameterGather`: ``deepspeed.zero.
GatheredParameters``, or ``DTensor.full_tensor`` for FSDP2): every rank must run the same gathers in the
same order, so every rank iterates :class:`SyncTensors` — rank 0 sends what it yields, the others call
:meth:`SyncTensors.drain` — and a consumer that stops early drains the rest, so no rank is left waiting
in a gather. Only one bucket of whole parameters exists at a time. Adapter export and LoRA merging are
not supported on sharded parameters (``config.sharding`` refuses them at load).

Names. ``full`` yields Hugging Face ``state_dict`` names of the unwrapped model
(``model.visual.*``, ``model.language_model.*``, ``lm_head.weight``); vLLM's Qwen2-VL, Qwen2.5-VL
and Qwen3-VL loaders map exactly these (``hf_to_vllm_mapper``). With tied embeddings
``lm_head.weight`` is the embedding tensor and is not yielded (vLLM ties it itself). ``adapter``
yields the PEFT checkpoint names vLLM's LoRA loader parses (``parse_fine_tuned_lora_name``):
``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight`` (adapter name removed), exactly
what ``peft.get_peft_model_state_dict`` saves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

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


class ParameterGather(Protocol):
    """How a training engine makes its sharded parameters whole; ``gathered`` is a collective."""

    name: str

    def is_sharded(self, param: torch.Tensor) -> bool: ...

    def full_nbytes(self, param: torch.Tensor) -> int: ...

    def gathered(
        self, params: Sequence[torch.Tensor]
    ) -> contextlib.AbstractContextManager[list[torch.Tensor]]:
        """Inside: the whole tensors of ``params`` (in order), valid until the context exits."""
        ...


class Zero3Gather:
    """DeepSpeed ZeRO-3: ``GatheredParameters`` makes ``param.data`` whole on every rank until it exits.

    ``gathered_parameters`` is DeepSpeed's context manager (injectable where DeepSpeed cannot run).
    """

    name = "DeepSpeed ZeRO-3"

    def __init__(self, gathered_parameters: Callable[..., Any] | None = None):
        if gathered_parameters is None:
            from deepspeed.zero import GatheredParameters

            gathered_parameters = GatheredParameters
        self._gathered_parameters = gathered_parameters

    def is_sharded(self, param: torch.Tensor) -> bool:
        return hasattr(param, "ds_id")

    def full_nbytes(self, param: torch.Tensor) -> int:
        return int(param.ds_numel) * param.element_size()  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def gathered(self, params: Sequence[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
        with self._gathered_parameters(list(params), modifier_rank=None):  # read-only: nothing written back
            yield [param.data for param in params]


class DTensorGather:
    """FSDP2 (``fully_shard``): parameters are ``DTensor`` s; ``full_tensor`` all-gathers one of them."""

    name = "FSDP2"

    def is_sharded(self, param: torch.Tensor) -> bool:
        from torch.distributed.tensor import DTensor

        return isinstance(param, DTensor)

    def full_nbytes(self, param: torch.Tensor) -> int:
        return param.numel() * param.element_size()  # a DTensor reports its global shape

    @contextlib.contextmanager
    def gathered(self, params: Sequence[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
        with torch.no_grad():
            yield [param.full_tensor() for param in params]  # type: ignore[attr-defined]


def parameter_gather(model: nn.Module) -> ParameterGather | None:
    """The gather for ``model``'s sharded parameters, or None when every rank holds them whole."""
    # ZeRO-3 and FSDP2 shard all parameters or none of a module, so the first one tells.
    param = next(iter(strip_parallel_wrappers(model).parameters()), None)
    if param is None:
        return None
    if hasattr(param, "ds_id"):
        try:
            return Zero3Gather()
        except ImportError as exc:
            raise SyncError(
                f"parameters are partitioned by DeepSpeed ZeRO-3 but DeepSpeed does not import: {exc}"
            ) from exc
    gather = DTensorGather()
    return gather if gather.is_sharded(param) else None


class SyncTensors:
    """The ``(name, tensor)`` pairs of one export, as an iterator every rank must exhaust or :meth:`drain`.

    Unsharded models export as :func:`iter_sync_tensors` describes (``drain`` does nothing). Sharded ones
    (``gather`` given or detected) export their full weights in gather groups of at most ``gather_bytes``
    of whole parameters; yielded tensors are copies, valid after their group is released.

    ``skip_frozen``: leave out parameters with ``requires_grad=False`` (``training.freeze``), for an
    engine that already holds them (they never change). Ignored for PEFT models, whose frozen base
    weights are merged with changing adapters.
    """

    def __init__(
        self,
        model: nn.Module,
        mode: SyncMode,
        *,
        gather: ParameterGather | None = None,
        gather_bytes: int = 64 << 20,
        skip_frozen: bool = False,
    ):
        inner = strip_parallel_wrappers(model)
        self.gather = gather if gather is not None else parameter_gather(inner)
        self.gathers_run = 0
        self._skip = frozen_parameter_names(inner) if skip_frozen and not is_peft_model(inner) else set()
        if self.gather is None:
            self._iterator = _iter_unsharded(inner, mode, self._skip)
        elif mode != "full" or is_peft_model(inner):
            raise SyncError(
                f"parameters sharded by {self.gather.name} can only be exported whole (full sync, no LoRA): set "
                "`custom.extra.rollout_matching.vllm.sync.mode: full` and `model.lora.enabled: false`"
            )
        else:
            self._iterator = self._iter_gathered(inner, self.gather, gather_bytes)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._iterator

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._iterator)

    def drain(self) -> None:
        """Run every gather not yet run (copying nothing), so this rank leaves no other rank waiting."""
        if self.gather is None:
            self._iterator.close()  # type: ignore[attr-defined]
            return
        self._keep = False
        for _ in self._iterator:
            pass

    def _iter_gathered(
        self, inner: nn.Module, gather: ParameterGather, gather_bytes: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        self._keep = True
        group: list[tuple[str, torch.Tensor]] = []
        used = 0
        seen: set[int] = set()  # tied parameters (lm_head = embeddings): exported once
        for key, tensor in inner.state_dict(keep_vars=True).items():
            if key in self._skip:
                continue
            size = (
                gather.full_nbytes(tensor)
                if gather.is_sharded(tensor)
                else tensor.numel() * tensor.element_size()
            )
            if group and used + size > gather_bytes:
                yield from self._gather_group(group, gather, seen)
                group, used = [], 0
            group.append((key, tensor))
            used += size
        if group:
            yield from self._gather_group(group, gather, seen)

    def _gather_group(
        self, group: list[tuple[str, torch.Tensor]], gather: ParameterGather, seen: set[int]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        params = list({id(t): t for _, t in group if gather.is_sharded(t)}.values())
        with gather.gathered(params) as whole:
            self.gathers_run += 1
            by_id = {id(param): full for param, full in zip(params, whole, strict=True)}
            for key, tensor in group:
                name = _full_name(key, "")
                if name is None or (name.startswith("lm_head.") and id(tensor) in seen):
                    continue
                seen.add(id(tensor))
                if self._keep:
                    yield name, by_id.get(id(tensor), tensor).detach().clone()


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
    return iter(SyncTensors(model, mode))


def frozen_parameter_names(model: nn.Module) -> set[str]:
    """``state_dict`` keys of the parameters that are not trained (``requires_grad=False``)."""
    return {name for name, param in model.named_parameters(remove_duplicate=False) if not param.requires_grad}


def _iter_unsharded(
    inner: nn.Module,
    mode: SyncMode,
    skip: set[str] = frozenset(),  # type: ignore[assignment]
) -> Iterator[tuple[str, torch.Tensor]]:
    if mode == "adapter":
        yield from _iter_adapter_tensors(inner)
    elif mode == "full":
        yield from _iter_full_tensors(inner, skip)
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
    named: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int = 64 << 20,
    on_filled: Callable[[Bucket, int], None] | None = None,
) -> Iterator[Bucket]:
    """Pack tensors into ``uint8`` buckets of at most ``bucket_bytes`` (a bigger tensor gets its own).

    Every tensor is copied (so the bucket stays valid after the source changes) at a 16-byte
    aligned offset; order is preserved across and within buckets. ``on_filled(bucket, end)`` is
    called with ``end = 0`` once the bucket's layout is known (its buffer still being filled), then
    after each tensor's copy: bytes ``[0, end)`` are final (padding included), so a caller can start
    sending and digesting them before the bucket is complete.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    pending: list[tuple[str, torch.Tensor]] = []
    used = 0
    for name, tensor in named:
        size = _aligned(tensor.numel() * tensor.element_size())
        if pending and used + size > bucket_bytes:
            yield _pack(pending, on_filled)
            pending, used = [], 0
        pending.append((name, tensor.detach()))
        used += size
    if pending:
        yield _pack(pending, on_filled)


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
def _iter_full_tensors(inner: nn.Module, skip: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
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
        if name is None or key in skip:
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


def _pack(pending: list[tuple[str, torch.Tensor]], on_filled: Callable[[Bucket, int], None] | None) -> Bucket:
    metas: list[TensorMeta] = []
    offset = 0
    for name, tensor in pending:
        metas.append(TensorMeta(name, _dtype_name(tensor.dtype), tuple(tensor.shape), offset, tensor.numel()))
        offset += _aligned(tensor.numel() * tensor.element_size())
    # Not torch.zeros: zero-filling first touched every page of the buffer before the first byte was
    # copied (two thirds of packing a 64 MiB bucket here); only the padding is zeroed.
    bucket = Bucket(metas=metas, flat=torch.empty(offset, dtype=torch.uint8, device=pending[0][1].device))
    if on_filled is not None:
        on_filled(bucket, 0)
    ends = [m.offset for m in metas[1:]] + [offset]  # a tensor's bytes and its padding
    for meta, (_, tensor), end in zip(metas, pending, ends, strict=True):
        bucket.flat[meta.offset : meta.offset + meta.nbytes].copy_(_as_bytes(tensor.to(bucket.flat.device)))
        bucket.flat[meta.offset + meta.nbytes : end].zero_()
        if on_filled is not None:
            on_filled(bucket, end)
    return bucket


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
