"""The colocated vLLM rollout backend: an engine in the trainer process, on the training devices.

Owns: :class:`VllmColocateBackend` (the :class:`~rollmatch.rollout.types.RolloutBackend` for
``rollout_backend: vllm`` + ``vllm.mode: colocate``): request -> engine -> :class:`Rollout`
conversion, the weight version, full / adapter weight sync with the one-way fallback from adapter
to full, sleep-mode wake-ups, and tensor-parallel request exchange under torchrun. Leaves out: the
engine itself (``rollout.vllm_engine``), what is exported (``sync.weights``) and moving training
state off the device (``training.offload``).

Every learner rank owns one engine (``tensor_parallel_size`` 1: data-parallel rollouts) or one
shard of an engine spanning ``tensor_parallel_size`` consecutive ranks (the ranks of a group
exchange their requests, all generate the group's batch, and each keeps its own rollouts).
Every rank loads weights from its own model replica, so no weights cross ranks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Literal

import torch

from rollmatch.collectives import Collectives, LocalCollectives
from rollmatch.config.resolved import ResolvedRun
from rollmatch.errors import SyncError
from rollmatch.rollout.types import Decoding, Rollout, RolloutProvenance, RolloutRequest, SyncReport
from rollmatch.rollout.vllm_engine import VllmEngine, VllmOutput
from rollmatch.rollout.vllm_settings import VLLM_KEY, engine_settings_from_config, require_vllm
from rollmatch.sync.weights import SyncTensors, iter_sync_tensors, peft_adapter_config

log = logging.getLogger(__name__)


class VllmColocateBackend:
    """Rollouts from an in-process vLLM engine whose weights follow the training model."""

    name = "vllm_colocate"

    def __init__(
        self,
        engine: VllmEngine,
        *,
        model: torch.nn.Module,
        tokenizer: Any,
        sync_mode: Literal["full", "adapter"] = "full",
        fallback_to_full: bool = True,
        collectives: Collectives | None = None,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.sync_mode = sync_mode
        self.fallback_to_full = fallback_to_full
        self.collectives = collectives or LocalCollectives()
        self._model = model
        self._version = 0
        self._frozen_loaded = False  # frozen weights (training.freeze) already in the engine
        self._tp = engine.settings.tensor_parallel_size

    @classmethod
    def from_config(
        cls, run: ResolvedRun, *, model: Any, tokenizer: Any, collectives: Collectives
    ) -> VllmColocateBackend:
        """The backend of a resolved run (its rules were checked when it was resolved); the engine
        starts lazily, at the first generation or sync. Raises :class:`ConfigError` when vLLM is
        not installed."""
        require_vllm()
        return cls(
            VllmEngine(engine_settings_from_config(run.config, run.model_dir)),
            model=model,
            tokenizer=tokenizer,
            sync_mode=run.sync_mode,
            fallback_to_full=run.config.rollout.vllm.sync.fallback_to_full,
            collectives=collectives,
        )

    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, requests: Sequence[RolloutRequest], decoding: Decoding, seed: int) -> list[Rollout]:
        """Roll out ``requests`` (request ``i`` sampled with ``seed + i``) with the synced weights."""
        self._wake_engine()
        batch, own, batch_seed = self._tensor_parallel_batch(list(requests), seed)
        outputs = self.engine.generate(batch, decoding, batch_seed)
        return [self._rollout(batch[i], outputs[i], decoding, batch_seed + i) for i in own]

    def sync_weights(self, model: Any, version: int) -> SyncReport:
        """Push ``model``'s weights (merged, or adapters only) into the engine; serve them as ``version``."""
        self._model = model
        start = time.perf_counter()
        self.engine.start()
        if self.engine.wake_up():  # level 2 dropped the weights: the load below must bring all of them
            self._frozen_loaded = False
        if self.sync_mode == "adapter":
            num_bytes = self._try_adapter_sync(model, version)
            if num_bytes is None:
                num_bytes = self._full_sync(model, skip_frozen=self._frozen_loaded)
        else:
            num_bytes = self._full_sync(model, skip_frozen=self._frozen_loaded)
        self._version = int(version)
        return SyncReport(
            version=self._version,
            num_bytes=num_bytes,
            seconds=time.perf_counter() - start,
            mode=self.sync_mode,
        )

    def release_device_memory(self) -> None:
        """Put the engine to sleep (``vllm.sleep_level``; 0: no-op) until its next generation or sync.

        Called by ``training.offload.rollout_offload`` at the end of each rollout phase."""
        self.engine.sleep()

    def close(self) -> None:
        self.engine.close()

    # ------------------------------------------------------------------------------------ private
    def _wake_engine(self) -> None:
        self.engine.start()
        if self.engine.wake_up():  # level 2 dropped the weights: reload the ones we serve
            self._full_sync(self._model)

    def _full_sync(self, model: Any, *, skip_frozen: bool = False) -> int:
        # every rank loads its engine: every rank runs the same gathers
        tensors = SyncTensors(model, "full", skip_frozen=skip_frozen)
        try:
            num_bytes = self.engine.load_weights(tensors)
        finally:
            tensors.drain()
        self._frozen_loaded = True
        return num_bytes

    def _try_adapter_sync(self, model: Any, version: int) -> int | None:
        """Adapter bytes sent, or None after switching to full sync for the rest of the run."""
        try:
            return self.engine.load_adapter(
                iter_sync_tensors(model, "adapter"), peft_adapter_config(model), version + 1
            )
        except Exception as exc:  # any engine or export failure: the fallback decision is the config's
            if not self.fallback_to_full:
                raise SyncError(
                    f"adapter weight sync failed at version {version}: {exc}. Set `{VLLM_KEY}.sync.mode: full`, "
                    f"or `{VLLM_KEY}.sync.fallback_to_full: true` to switch to full sync automatically"
                ) from exc
            log.warning(
                "adapter weight sync failed (%s); switching to full weight sync for the rest of the run "
                "(%s.sync.fallback_to_full is true)",
                exc,
                VLLM_KEY,
            )
            self.sync_mode = "full"
            self.engine.drop_adapter()
            return None

    def _tensor_parallel_batch(
        self, requests: list[RolloutRequest], seed: int
    ) -> tuple[list[RolloutRequest], list[int], int]:
        """The batch this rank's engine runs, the indices of its own requests and the batch's seed.

        With tensor parallelism every rank of a group must run the identical batch: the group's
        requests in rank order, seeded from the group's first rank.
        """
        if self._tp == 1:
            return requests, list(range(len(requests))), seed
        rank = self.collectives.rank
        first = rank - rank % self._tp
        gathered = self.collectives.all_gather_object((requests, seed), phase="vllm tensor-parallel requests")
        group = gathered[first : first + self._tp]
        offset = sum(len(reqs) for reqs, _ in group[: rank - first])
        batch = [r for reqs, _ in group for r in reqs]
        return batch, list(range(offset, offset + len(requests))), group[0][1]

    def _rollout(self, request: RolloutRequest, out: VllmOutput, decoding: Decoding, seed: int) -> Rollout:
        return Rollout(
            sample_id=request.sample_id,
            prompt_token_ids=out.prompt_token_ids,
            response_token_ids=out.token_ids,
            text=out.text,
            finish_reason=out.finish_reason,
            weight_version=self._version,
            provenance=RolloutProvenance(backend=self.name, seed=seed, decoding=decoding),
            response_logprobs=out.logprobs,
            stop_token_id=out.stop_token_id,
            stop_logprob=out.stop_logprob,
        )
