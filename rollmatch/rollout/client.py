"""Server-mode rollout backend: the trainer's HTTP client to one or more ``rollmatch serve`` servers.

Owns: :class:`ServerConnection` (one server: reachability, JSON calls with timeouts, errors that
name the URL) and :class:`ServerBackend` (the ``RolloutBackend`` for
``custom.extra.rollout_matching.vllm.mode: server``): start-up checks (reachable, same model /
tokenizer / template / processor), request chunking over servers, and in-memory weight sync
through the update transaction. Leaves out: the wire shapes (``rollmatch.protocol``), the transaction
(``sync.transaction``) and the group (``sync.transport``).

Multi-process learners: every rank may generate; only rank 0 opens the weight-sync groups and
pushes. ``sync_weights`` is ``barrier -> rank 0 push -> broadcast of the outcome`` on every rank,
so no rank generates with stale weights and a failed push fails every rank; with sharded parameters
(ZeRO-3 / FSDP2) the other ranks take part in rank 0's per-bucket gathers (``sync.weights``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlparse

import requests

from rollmatch.collectives import Collectives
from rollmatch.config.rules import resolve_servers, resolve_sync_mode, sync_mode_problems
from rollmatch.config.schema import RollmatchConfig
from rollmatch.errors import BackendError, ConfigError, ConfigProblem, RollmatchError, SyncError
from rollmatch.models.wrappers import strip_parallel_wrappers
from rollmatch.protocol import (
    MAX_GROUP_TIMEOUT_S,
    PROTOCOL_VERSION,
    InferBody,
    InferRequest,
    InitCommunicatorBody,
    RolloutOutput,
    ServerInfo,
    WireModel,
    encode_image,
    fingerprint_mismatches,
    request_config_from_decoding,
)
from rollmatch.rollout.chunking import contiguous_chunks
from rollmatch.rollout.types import Decoding, Rollout, RolloutProvenance, RolloutRequest, SyncReport
from rollmatch.sync.transaction import AdapterPayload, push_update
from rollmatch.sync.transport import GroupTransport, default_backend
from rollmatch.sync.weights import SyncTensors, peft_adapter_config

log = logging.getLogger(__name__)
API_KEY_ENV = "ROLLMATCH_API_KEY"  # the same variable `rollmatch serve` reads for --api-key
LEASE_HEADER = "X-Rollmatch-Sync-Lease"  # server.sync_session.LEASE_HEADER
_HEALTH_POLL_S = 5.0
_KEY = "custom.extra.rollout_matching.vllm"
_ALTERNATIVES = f"or set `{_KEY}.mode: colocate` / `custom.extra.rollout_matching.rollout_backend: hf`"


class ServerConnection:
    """One rollout server: JSON over HTTP with explicit timeouts; implements ``ControlChannel``.

    Every request carries ``Authorization: Bearer $ROLLMATCH_API_KEY`` when that variable is set,
    and, once ``/init_communicator/`` handed one out, the sync lease. A call made without an HTTP
    timeout (``/infer/`` with ``infer_timeout_s: null``) is watched: ``/health/`` is polled while it
    is outstanding, and the call fails naming the URL once the server stops answering for
    ``timeout_s`` or reports itself unhealthy.
    """

    def __init__(self, url: str, group_port: int, *, timeout_s: float, infer_timeout_s: float | None):
        self.url = url.rstrip("/")
        self.group_port = group_port
        self.timeout_s = timeout_s
        self.infer_timeout_s = infer_timeout_s if infer_timeout_s and infer_timeout_s > 0 else None
        self.host = urlparse(self.url).hostname or "127.0.0.1"
        self.session = requests.Session()
        api_key = os.environ.get(API_KEY_ENV)
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        self.sync_lease: str | None = None

    def wait_healthy(self) -> None:
        """Poll ``/health/`` until it answers, at most ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        last = "no answer"
        while True:
            try:
                reply = self.session.get(f"{self.url}/health/", timeout=min(5.0, self.timeout_s))
                if reply.status_code == 200:
                    return
                last = f"HTTP {reply.status_code}: {reply.text[:200]}"
            except requests.RequestException as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise BackendError(
                    f"rollout server {self.url} is not reachable after {self.timeout_s:.0f}s "
                    f"({_KEY}.server.timeout_s); last error: {last}. Start it with `rollmatch serve --model "
                    f"<model.path> --port <port>` and check the URL, {_ALTERNATIVES}"
                )
            time.sleep(0.5)

    def get(self, path: str, phase: str) -> dict[str, Any]:
        return self._call("GET", path, None, phase, self.timeout_s)

    def post(self, path: str, body: WireModel | None, phase: str, timeout_s: float | None = -1.0) -> Any:
        timeout = self.timeout_s if timeout_s == -1.0 else timeout_s
        if timeout is None:
            return self._watched_call("POST", path, body, phase)
        return self._call("POST", path, body, phase, timeout)

    def _call(self, method: str, path: str, body: WireModel | None, phase: str, timeout: float | None) -> Any:
        payload = None if body is None else body.model_dump(mode="json", exclude_none=True)
        headers = {LEASE_HEADER: self.sync_lease} if self.sync_lease else None
        try:
            reply = self.session.request(
                method, f"{self.url}{path}", json=payload, timeout=timeout, headers=headers
            )
        except requests.Timeout as exc:
            raise BackendError(
                f"rollout server {self.url}: {phase} ({method} {path}) got no answer within {timeout}s"
            ) from exc
        except requests.RequestException as exc:
            raise BackendError(
                f"rollout server {self.url}: {phase} ({method} {path}) failed: {exc}; is the server still "
                f"running? {_ALTERNATIVES}"
            ) from exc
        if reply.status_code != 200:
            detail = _detail(reply)
            error = SyncError if reply.status_code == 409 else BackendError
            hint = f" (set {API_KEY_ENV} to the server's --api-key)" if reply.status_code == 401 else ""
            raise error(
                f"rollout server {self.url}: {phase} ({method} {path}) -> HTTP {reply.status_code}: {detail}{hint}"
            )
        return reply.json()

    def _watched_call(self, method: str, path: str, body: WireModel | None, phase: str) -> Any:
        """A call without an HTTP timeout, run in a daemon thread while ``/health/`` is polled here."""
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                outcome["value"] = self._call(method, path, body, phase, None)
            except BaseException as exc:  # handed to the caller's thread below
                outcome["error"] = exc
            finally:
                done.set()

        threading.Thread(target=run, name=f"rollout-call {self.url}", daemon=True).start()
        probe = requests.Session()
        probe.headers.update(self.session.headers)
        last_answer, last_problem = time.monotonic(), "no answer yet"
        poll_s = max(0.2, min(_HEALTH_POLL_S, self.timeout_s / 4))
        try:
            while not done.wait(poll_s):
                try:
                    reply = probe.get(f"{self.url}/health/", timeout=min(_HEALTH_POLL_S, self.timeout_s))
                except requests.RequestException as exc:
                    last_problem = f"{type(exc).__name__}: {exc}"
                else:
                    if reply.status_code == 200:
                        last_answer = time.monotonic()
                        continue
                    if reply.status_code == 503:  # broken or stalled: it will not answer this call
                        raise BackendError(
                            f"rollout server {self.url}: {phase} ({method} {path}) abandoned: the server reports "
                            f"itself unhealthy: {_detail(reply)}; restart it"
                        )
                    last_problem = f"HTTP {reply.status_code}"
                if time.monotonic() - last_answer > self.timeout_s:
                    raise BackendError(
                        f"rollout server {self.url}: {phase} ({method} {path}) abandoned: GET /health/ got no "
                        f"answer for {self.timeout_s:.0f}s ({_KEY}.server.timeout_s; last: {last_problem}); the "
                        f"server is frozen or gone. Restart it, {_ALTERNATIVES}"
                    )
        finally:
            probe.close()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def close(self) -> None:
        self.session.close()


def _detail(reply: requests.Response) -> str:
    try:
        return str(reply.json().get("detail", reply.text))[:2000]
    except ValueError:
        return reply.text[:2000]


class ServerBackend:
    """Rollouts from rollout servers; weights pushed in memory by rank 0 (see the module docstring)."""

    name = "vllm_server"

    def __init__(
        self,
        connections: Sequence[ServerConnection],
        *,
        collectives: Collectives,
        tokenizer: Any,
        sync_mode: str = "full",
        fallback_to_full: bool = True,
        bucket_bytes: int = 64 << 20,
    ):
        if not connections:
            raise BackendError("ServerBackend needs at least one server connection")
        self.connections = list(connections)
        self.collectives = collectives
        self.tokenizer = tokenizer
        self.sync_mode = sync_mode
        self.fallback_to_full = fallback_to_full
        self.bucket_bytes = bucket_bytes
        self._version = 0
        self._transports: list[GroupTransport] = []
        self._group_stale = True
        self._closed = False

    @classmethod
    def from_config(
        cls, cfg: RollmatchConfig, *, model: Any, tokenizer: Any, model_dir: str, collectives: Collectives
    ) -> ServerBackend:
        """Connect, cross-check every server against the trainer's model, fail fast on any problem."""
        vllm = cfg.rollout.vllm
        endpoints = resolve_servers(vllm.server)
        if not endpoints:
            raise ConfigError(
                [
                    ConfigProblem(
                        f"{_KEY}.server.servers",
                        None,
                        "server mode needs at least one server entry ({base_url, group_port})",
                    )
                ]
            )
        problems = sync_mode_problems(cfg, world_size=collectives.world_size)
        if problems:
            raise ConfigError(problems)
        mode = resolve_sync_mode(cfg)
        connections = [
            ServerConnection(
                e.base_url,
                e.group_port,
                timeout_s=vllm.server.timeout_s,
                infer_timeout_s=vllm.server.infer_timeout_s,
            )
            for e in endpoints
        ]
        backend = cls(
            connections,
            collectives=collectives,
            tokenizer=tokenizer,
            sync_mode=mode,
            fallback_to_full=vllm.sync.fallback_to_full,
        )
        with ThreadPoolExecutor(max_workers=len(connections)) as pool:
            list(pool.map(ServerConnection.wait_healthy, connections))
        backend.check_compatible(local_model_info(cfg, model, model_dir))
        backend._align_initial_version(model)
        return backend

    # -------------------------------------------------------------------------------- protocol
    @property
    def weight_version(self) -> int:
        return self._version

    def check_compatible(self, local_info: dict[str, Any]) -> None:
        """Refuse to train against a server that serves another model, tokenizer, template or processor.

        ``local_info``: ``{"fingerprint": model_fingerprint(...), "max_length": int}``.
        """
        problems: list[str] = []
        for conn in self.connections:
            info = ServerInfo.model_validate(conn.get("/info/", "start-up cross-check"))
            lines = fingerprint_mismatches(local_info["fingerprint"], info.fingerprint)
            if info.protocol_version != PROTOCOL_VERSION:
                lines.append(
                    f"protocol_version: trainer {PROTOCOL_VERSION} vs server {info.protocol_version}"
                )
            if info.max_model_len < int(local_info.get("max_length", 0)):
                lines.append(
                    f"max length: trainer training.global_max_length {local_info['max_length']} vs server "
                    f"max_model_len {info.max_model_len} (serve with --max-model-len >= it)"
                )
            if self.sync_mode == "adapter" and "adapter" not in info.sync_modes and not self.fallback_to_full:
                lines.append(f"sync modes: trainer needs adapter, server offers {info.sync_modes}")
            problems.extend(f"{conn.url}: {line}" for line in lines)
        if problems:
            listed = "\n  ".join(problems)
            raise BackendError(
                f"rollout server(s) do not match the trainer:\n  {listed}\nServe the trainer's model directory "
                "(`rollmatch serve --model <model.path>`) with the same processor settings (data.min_pixels / "
                "data.max_pixels saved into that directory)"
            )

    def generate(self, requests: Sequence[RolloutRequest], decoding: Decoding, seed: int) -> list[Rollout]:
        """Split into contiguous chunks (one per server), roll out in parallel, keep request order.

        ``seed`` is the step's seed (:func:`~rollmatch.rollout.chunking.step_seed`); the chunk starting
        at request ``s`` is sent with ``seed + s``.
        """
        if not requests:
            return []
        jobs = [
            (conn, start, end)
            for conn, (start, end) in zip(
                self.connections, contiguous_chunks(len(requests), len(self.connections)), strict=True
            )
            if end > start
        ]
        if not decoding.greedy:
            log.info(
                "rollout sampling: temperature=%s top_p=%s top_k=%s repetition_penalty=%s max_new_tokens=%d; "
                "chunk seeds %s",
                decoding.temperature,
                decoding.top_p,
                decoding.top_k,
                decoding.repetition_penalty,
                decoding.max_new_tokens,
                {conn.url: seed + start for conn, start, _ in jobs},
            )
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            futures = [
                pool.submit(self._infer_chunk, conn, requests[start:end], decoding, seed + start)
                for conn, start, end in jobs
            ]
            return [rollout for future in futures for rollout in future.result()]

    def _infer_chunk(
        self, conn: ServerConnection, chunk: Sequence[RolloutRequest], decoding: Decoding, seed: int
    ) -> list[Rollout]:
        body = InferBody(
            infer_requests=[
                InferRequest(
                    prompt_token_ids=list(r.prompt_token_ids),
                    images=[encode_image(image) for image in r.images],
                    sample_id=r.sample_id,
                )
                for r in chunk
            ],
            request_config=request_config_from_decoding(decoding, seed),
        )
        raw = conn.post(
            "/infer/", body, f"rollout of {len(chunk)} request(s)", timeout_s=conn.infer_timeout_s
        )
        if not isinstance(raw, list) or len(raw) != len(chunk):
            got = len(raw) if isinstance(raw, list) else type(raw).__name__
            raise BackendError(f"rollout server {conn.url}: sent {len(chunk)} requests, got {got} outputs")
        provenance = RolloutProvenance(backend=self.name, seed=seed, decoding=decoding, server=conn.url)
        rollouts = []
        for request, item in zip(chunk, raw, strict=True):
            output = RolloutOutput.model_validate(item)
            choice = output.response.choices[0]
            if choice.token_ids is None or output.response.prompt_token_ids is None:
                raise BackendError(
                    f"rollout server {conn.url} returned no token ids (return_details ignored)"
                )
            rollouts.append(
                Rollout(
                    sample_id=request.sample_id,
                    prompt_token_ids=output.response.prompt_token_ids,
                    response_token_ids=choice.token_ids,
                    text=choice.message.content,
                    finish_reason=choice.finish_reason,
                    weight_version=output.weight_version,
                    provenance=provenance,
                )
            )
        return rollouts

    def sync_weights(self, model: Any, version: int) -> SyncReport:
        """``barrier -> rank 0 pushes -> every rank gets the outcome`` (a failure raises on every rank)."""
        coll = self.collectives
        coll.barrier(f"weight sync v{version}: before push")
        outcome: SyncReport | str | None = None
        failure: RollmatchError | None = None
        if coll.is_main:
            try:
                outcome = self._push(model, version)
            except RollmatchError as exc:
                failure, outcome = exc, f"{type(exc).__name__}: {exc}"
        else:  # sharded parameters (ZeRO-3 / FSDP2): take part in rank 0's per-bucket gathers
            SyncTensors(model, self.sync_mode).drain()  # type: ignore[arg-type]
        outcome = coll.broadcast_object(outcome, f"weight sync v{version}: after push")
        if failure is not None:
            raise failure
        if isinstance(outcome, str):
            raise SyncError(f"rank 0's weight push of version {version} failed: {outcome}")
        self._version = outcome.version
        return outcome

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_groups(notify=True)
        for conn in self.connections:
            conn.close()

    def _align_initial_version(self, model: Any) -> None:
        """A server that already serves pushed weights (an earlier run) first gets the trainer's as v0."""
        stale: list[str] = []
        if self.collectives.is_main:
            for conn in self.connections:
                version = ServerInfo.model_validate(
                    conn.get("/info/", "start-up version check")
                ).weight_version
                if version != 0:
                    stale.append(f"{conn.url} (v{version})")
        stale = self.collectives.broadcast_object(stale, "start-up version check")
        if stale:
            log.warning(
                "rollout server(s) %s serve weights of an earlier run: pushing the trainer's as v0", stale
            )
            self.sync_weights(model, 0)

    # --------------------------------------------------------------------------------- rank 0
    def _push(self, model: Any, version: int) -> SyncReport:
        if self.sync_mode == "adapter":
            try:
                return self._push_mode(model, version, "adapter")
            except SyncError as exc:
                if not self.fallback_to_full:
                    raise SyncError(
                        f"adapter sync failed: {exc}. Set `{_KEY}.sync.fallback_to_full: true` or "
                        f"`{_KEY}.sync.mode: full`"
                    ) from exc
                log.warning("adapter sync failed (%s); using full sync for the rest of the run", exc)
                self.sync_mode = "full"
        return self._push_mode(model, version, "full")

    def _push_mode(self, model: Any, version: int, mode: str) -> SyncReport:
        tensors = SyncTensors(model, mode)  # type: ignore[arg-type]
        try:
            if self._group_stale:
                self._open_groups(model)
            adapter = (
                AdapterPayload(peft_adapter_config(model), lora_int_id=version + 1)
                if mode == "adapter"
                else None
            )
            targets = list(zip(self.connections, self._transports, strict=True))
            result = push_update(
                targets,
                tensors,
                version=version,
                mode=mode,  # type: ignore[arg-type]
                bucket_bytes=self.bucket_bytes,
                adapter=adapter,
            )
        except RollmatchError:
            self._group_stale = True  # a half-sent bucket leaves the group out of step: rebuild it next time
            raise
        finally:
            tensors.drain()  # whatever failed, run the gathers other ranks wait in (sharded parameters)
        return SyncReport(version=version, num_bytes=result.num_bytes, seconds=result.seconds, mode=mode)  # type: ignore[arg-type]

    def _open_groups(self, model: Any) -> None:
        """Close stale groups, then form one private group per server (trainer = last rank)."""
        self._close_groups(notify=True)
        device = next(strip_parallel_wrappers(model).parameters()).device
        backend = default_backend(device)
        for conn in self.connections:
            server_ranks = int(conn.get("/get_world_size/", "communicator init")["world_size"])
            group_host = socket.gethostbyname(conn.host)  # the server listens on the address we reach it at
            body = InitCommunicatorBody(
                host=group_host,
                port=conn.group_port,
                world_size=server_ranks + 1,
                backend=backend,
                timeout_s=min(conn.timeout_s, MAX_GROUP_TIMEOUT_S),
            )
            conn.sync_lease = None
            reply = conn.post("/init_communicator/", body, "communicator init")
            conn.sync_lease = reply.get("lease") if isinstance(reply, dict) else None
            self._transports.append(
                GroupTransport(
                    host=group_host,
                    port=conn.group_port,
                    rank=server_ranks,
                    world_size=server_ranks + 1,
                    backend=backend,
                    timeout_s=conn.timeout_s,
                    device=device,
                )
            )
        self._group_stale = False

    def _close_groups(self, *, notify: bool) -> None:
        for transport in self._transports:
            transport.close()
        if notify and self.collectives.is_main:
            for conn in self.connections:
                try:
                    conn.post(
                        "/close_communicator/",
                        None,
                        "close communicator",
                        timeout_s=min(conn.timeout_s, 10.0),
                    )
                except BackendError as exc:  # the server may be gone already; closing must still finish
                    log.warning("%s", exc)
                conn.sync_lease = None
        self._transports = []
        self._group_stale = True


def local_model_info(cfg: RollmatchConfig, model: Any, model_dir: str) -> dict[str, Any]:
    """What :meth:`ServerBackend.check_compatible` compares: the trainer's fingerprint and max length."""
    from transformers import AutoProcessor

    from rollmatch.data.prompts import set_pixel_bounds
    from rollmatch.protocol import model_fingerprint

    processor = AutoProcessor.from_pretrained(str(model_dir))
    if cfg.data.min_pixels is not None or cfg.data.max_pixels is not None:
        set_pixel_bounds(processor, cfg.data.min_pixels, cfg.data.max_pixels)
    config = strip_parallel_wrappers(model).config if model is not None else None
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(model_dir))
    return {"fingerprint": model_fingerprint(config, processor), "max_length": cfg.training.global_max_length}
