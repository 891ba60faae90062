"""Server-mode rollout backend: the trainer's HTTP client to one or more ``rollmatch serve`` servers.

Owns: :class:`ServerBackend` (the ``RolloutBackend`` for
``custom.extra.rollout_matching.vllm.mode: server``): start-up checks (reachable; same model /
tokenizer / template / processor, family, coordinate frame, resize bounds and probe-image resize, as
``rollout.server_compat`` compares them), request chunking over servers and the ``/infer/`` exchange
with its :class:`InferTiming`. Leaves out: weight pushes (``rollout.weight_push``: the backend's
``pusher``, which ``sync_weights`` hands to), one server's HTTP calls (``rollout.connection``),
server health and failover (``rollout.server_pool``) and the wire shapes (``rollmatch.protocol``).

Several servers (``rollout.server_pool``): a server that stops answering is marked down and its
unfinished chunk re-sent to a healthy one, while at least ``vllm.server.min_healthy`` servers are up
(default: all of them, so the first failure ends the run). A down server is used again once the pusher
re-synced it (or it answers at a version pushed to it).

Multi-process learners: every rank may generate; ``sync_weights`` is a collective every rank calls,
and only rank 0 pushes.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rollmatch.collectives import Collectives
from rollmatch.config.resolved import ResolvedRun
from rollmatch.errors import BackendError
from rollmatch.protocol import (
    SERVER_TIMING_HEADER,
    InferBody,
    InferRequest,
    ServerInfo,
    parse_server_timing,
    request_config_from_decoding,
)
from rollmatch.rollout.chunking import contiguous_chunks
from rollmatch.rollout.connection import ServerConnection, encode_body
from rollmatch.rollout.image_wire import ImageWire, OriginalPng, build_image_wire
from rollmatch.rollout.replies import parse_infer_reply, reply_rollout
from rollmatch.rollout.server_compat import LocalModelInfo, local_model_info, server_mismatches
from rollmatch.rollout.server_pool import ServerPool
from rollmatch.rollout.types import Decoding, Rollout, RolloutProvenance, RolloutRequest, SyncReport
from rollmatch.rollout.weight_push import WeightPushCoordinator

__all__ = ["InferTiming", "ServerBackend", "ServerConnection"]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InferTiming:
    """Where one ``/infer/`` call of one server spent its time (seconds; bytes on the wire).

    Client side: ``encode_s`` (images to base64), ``serialize_s`` (body to JSON bytes),
    ``round_trip_s`` (request sent to answer read: transfer, HTTP and the server), ``parse_s``
    (answer JSON to rollouts). ``server_s``: the server's own phases from its ``Server-Timing``
    header (``receive``, ``parse``, ``prepare``, ``decode``, ``engine``, ``outputs``, ``respond``).
    """

    server: str
    requests: int
    encode_s: float
    serialize_s: float
    round_trip_s: float
    parse_s: float
    request_bytes: int
    reply_bytes: int
    server_s: dict[str, float] = field(default_factory=dict)

    @property
    def transfer_s(self) -> float:
        """The round trip minus the server's measured phases: transfer, HTTP parsing, thread hops."""
        return self.round_trip_s - sum(self.server_s.values())


class ServerBackend:
    """Rollouts from rollout servers; weights pushed by its :class:`WeightPushCoordinator` (``pusher``)."""

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
        image_wire: ImageWire | None = None,
        min_healthy: int | None = None,
        rotate_servers: bool = False,
        first_server: int = 0,
    ):
        if not connections:
            raise BackendError("ServerBackend needs at least one server connection")
        self.connections = list(connections)
        self.pool = ServerPool(self.connections, min_healthy=min_healthy)
        self.collectives = collectives
        self.tokenizer = tokenizer
        self.image_wire: ImageWire = image_wire if image_wire is not None else OriginalPng()
        self.pusher = WeightPushCoordinator(
            self.connections,
            self.pool,
            collectives=collectives,
            sync_mode=sync_mode,
            fallback_to_full=fallback_to_full,
            bucket_bytes=bucket_bytes,
        )
        self._closed = False
        self.rotate_servers = rotate_servers
        self.first_server = int(first_server)  # with rotate_servers: where this client's first call starts
        self._calls = 0  # generate() calls so far: where the next one starts (with rotate_servers)
        self.last_infer_timings: list[InferTiming] = []  # one per server of the latest generate()

    @classmethod
    def connect(
        cls, run: ResolvedRun, *, model: Any, tokenizer: Any, processor: Any, collectives: Collectives
    ) -> ServerBackend:
        """Connect to the run's servers, cross-check each against the trainer's model, fail fast.

        Every rank calls it: it waits until each server is healthy, then rank 0 asks each for the weight
        version it serves and broadcasts the answer (a collective); servers that serve an earlier run's
        weights get the trainer's as version 0 (a weight push every rank joins).

        ``run`` was resolved (its rules checked) at start-up; ``processor`` is the trainer's one
        processor (``data.prompts.load_processor``), for the image wire and the cross-check.
        """
        vllm = run.config.rollout.vllm  # its servers: at least one (config.rules, checked by resolve_run)
        connections = [
            ServerConnection(
                e.base_url,
                e.group_port,
                timeout_s=vllm.server.timeout_s,
                infer_timeout_s=vllm.server.infer_timeout_s,
            )
            for e in run.servers
        ]
        backend = cls(
            connections,
            collectives=collectives,
            tokenizer=tokenizer,
            sync_mode=run.sync_mode,
            fallback_to_full=vllm.sync.fallback_to_full,
            image_wire=build_image_wire(vllm.server.image_wire, processor),
            min_healthy=vllm.server.min_healthy,
            rotate_servers=vllm.server.rotate_servers,
        )
        with ThreadPoolExecutor(max_workers=len(connections)) as pool:
            list(pool.map(ServerConnection.wait_healthy, connections))
        backend.check_compatible(local_model_info(run, model, processor))
        backend.pusher.push_v0_over_earlier_weights(model)
        return backend

    # -------------------------------------------------------------------------------- protocol
    @property
    def weight_version(self) -> int:
        """The version the servers serve: that of the last completed push."""
        return self.pusher.version

    @property
    def sync_mode(self) -> str:
        """``full`` or ``adapter`` (``adapter`` falls back to ``full`` for good once refused)."""
        return self.pusher.sync_mode

    @property
    def followers(self) -> list[ServerPool]:
        """The async actors' pools every push outcome reaches (:class:`WeightPushCoordinator`)."""
        return self.pusher.followers

    def check_compatible(self, local_info: LocalModelInfo) -> None:
        """Refuse to train against a server that serves another model, tokenizer, template or processor
        (``rollout.server_compat``: every mismatch of :func:`local_model_info` with each server's
        ``/info/``), or that cannot take the trainer's sync mode."""
        problems: list[str] = []
        for conn in self.connections:
            info = ServerInfo.model_validate(conn.get("/info/", "start-up cross-check"))
            lines = server_mismatches(local_info, info)
            if (
                self.sync_mode == "adapter"
                and "adapter" not in info.sync_modes
                and not self.pusher.fallback_to_full
            ):
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
        """Split into contiguous chunks (one per healthy server: healthy server ``i`` gets chunk ``i`` on
        every call, the seed's rule; with ``rotate_servers`` each call starts one server further on), roll
        out in parallel, keep request order.

        ``seed`` is the step's seed (:func:`~rollmatch.rollout.chunking.step_seed`); the chunk starting
        at request ``s`` is sent with ``seed + s``, also when it is re-sent to another server.
        """
        if not requests:
            return []
        servers = self.pool.usable()
        if self.rotate_servers:
            # Opt-in departure from the seed's rule: calls of fewer requests than servers (a single
            # record, an async actor's small call) spread over every server instead of all landing on
            # the first.
            first = (self.first_server + self._calls) % len(servers)
            servers = servers[first:] + servers[:first]
        self._calls += 1
        jobs = [
            (conn, (start, end))
            for conn, (start, end) in zip(
                servers, contiguous_chunks(len(requests), len(servers)), strict=True
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
                {conn.url: seed + start for conn, (start, _) in jobs},
            )

        def call(conn: ServerConnection, span: tuple[int, int]) -> tuple[list[Rollout], InferTiming]:
            start, end = span
            return self._infer_chunk(conn, requests[start:end], decoding, seed + start)

        chunks: list[tuple[list[Rollout], InferTiming]] = self.pool.run_chunks(jobs, call)  # type: ignore[assignment]
        self.last_infer_timings = [timing for _, timing in chunks]
        rollouts = [rollout for chunk, _ in chunks for rollout in chunk]
        for rollout in rollouts:
            self.pool.seen_version(rollout.weight_version)
        return rollouts

    def take_server_sums(self) -> Counter[str]:
        """``servers/*`` sums since the last call (:meth:`ServerPool.take_sums`)."""
        return self.pool.take_sums()

    def _infer_chunk(
        self, conn: ServerConnection, chunk: Sequence[RolloutRequest], decoding: Decoding, seed: int
    ) -> tuple[list[Rollout], InferTiming]:
        start = time.perf_counter()
        since = self.pool.served_version(conn)  # what this server answered at before this call was sent
        images = [self.image_wire.encode(r) for r in chunk]
        encoded = time.perf_counter()
        body = InferBody(
            infer_requests=[
                InferRequest(prompt_token_ids=list(r.prompt_token_ids), images=i, sample_id=r.sample_id)
                for r, i in zip(chunk, images, strict=True)
            ],
            request_config=request_config_from_decoding(decoding, seed),
        )
        payload = encode_body(body)
        serialized = time.perf_counter()
        reply = conn.post_bytes(
            "/infer/", payload, f"rollout of {len(chunk)} request(s)", timeout_s=conn.infer_timeout_s
        )
        answered = time.perf_counter()
        outputs = parse_infer_reply(conn, reply.content, len(chunk))
        provenance = RolloutProvenance(backend=self.name, seed=seed, decoding=decoding, server=conn.url)
        rollouts = [
            reply_rollout(conn, request, output, provenance)
            for request, output in zip(chunk, outputs, strict=True)
        ]
        # The newest version behind each answer (under `--update-mode keep` a long call may have started
        # under an older one than a shorter call that returned before it).
        newest = [
            o.weight_version if o.weight_version_last is None else o.weight_version_last for o in outputs
        ]
        self.pool.check_served(conn, newest, since=since)
        timing = InferTiming(
            server=conn.url,
            requests=len(chunk),
            encode_s=encoded - start,
            serialize_s=serialized - encoded,
            round_trip_s=answered - serialized,
            parse_s=time.perf_counter() - answered,
            request_bytes=len(payload),
            reply_bytes=len(reply.content),
            server_s=parse_server_timing(reply.headers.get(SERVER_TIMING_HEADER, "")),
        )
        return rollouts, timing

    def sync_weights(self, model: Any, version: int) -> SyncReport:
        """The learner's weights to every server it uses (:meth:`WeightPushCoordinator.sync_weights`: a
        collective every rank calls; rank 0 pushes)."""
        return self.pusher.sync_weights(model, version)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.pusher.close()
        for conn in self.connections:
            conn.close()
