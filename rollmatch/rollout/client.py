"""Server-mode rollout backend: the trainer's HTTP client to one or more ``rollmatch serve`` servers.

Owns: :class:`ServerBackend` (the ``RolloutBackend`` for
``custom.extra.rollout_matching.vllm.mode: server``): start-up checks (reachable; same model /
tokenizer / template / processor, family, coordinate frame, resize bounds and probe-image resize, as
``rollout.server_compat`` compares them),
request chunking over servers, the ``/infer/`` exchange with its :class:`InferTiming`, and in-memory
weight sync through the update transaction. Leaves out: one
server's HTTP calls (``rollout.connection``), the wire shapes (``rollmatch.protocol``), the
transaction (``sync.transaction``) and the group (``sync.transport``).

Several servers (``rollout.server_pool``): a server that stops answering is marked down and its
unfinished chunk re-sent to a healthy one, while at least ``vllm.server.min_healthy`` servers are up
(default: all of them, so the first failure ends the run). Pushes skip down servers; a down server
that answers ``/health/`` again gets the next push (fresh groups, full weights) and is used again only
then. A push that fails marks the servers that caused it down and is sent again, once, to the rest.

Multi-process learners: every rank may generate; only rank 0 opens the weight-sync groups and
pushes. ``sync_weights`` is ``barrier -> rank 0 push -> broadcast of the outcome`` on every rank,
so no rank generates with stale weights and a failed push fails every rank; with sharded parameters
(ZeRO-3 / FSDP2) the other ranks take part in rank 0's per-bucket gathers (``sync.weights``).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import socket
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rollmatch.collectives import Collectives
from rollmatch.config.resolved import ResolvedRun
from rollmatch.errors import (
    BackendError,
    ConfigError,
    ConfigProblem,
    RollmatchError,
    ServerSyncFailure,
    SyncError,
)
from rollmatch.models.wrappers import strip_parallel_wrappers
from rollmatch.protocol import (
    MAX_GROUP_TIMEOUT_S,
    SERVER_TIMING_HEADER,
    InferBody,
    InferRequest,
    InitCommunicatorBody,
    ServerInfo,
    parse_server_timing,
    request_config_from_decoding,
)
from rollmatch.rollout.chunking import contiguous_chunks
from rollmatch.rollout.connection import KEY, ServerConnection, encode_body
from rollmatch.rollout.image_wire import ImageWire, OriginalPng, build_image_wire
from rollmatch.rollout.replies import init_reply, parse_infer_reply, reply_rollout
from rollmatch.rollout.server_compat import LocalModelInfo, local_model_info, server_mismatches
from rollmatch.rollout.server_pool import ServerPool
from rollmatch.rollout.types import Decoding, Rollout, RolloutProvenance, RolloutRequest, SyncReport
from rollmatch.sync.digest import new_digest_key, parse_digest_key
from rollmatch.sync.transaction import AdapterPayload, push_update
from rollmatch.sync.transport import GroupTransport, default_backend
from rollmatch.sync.weights import SyncTensors, peft_adapter_config

__all__ = ["InferTiming", "ServerBackend", "ServerConnection"]
log = logging.getLogger(__name__)
_KEY = KEY


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


_RETRY_SHARDED = (
    "rollmatch: sharded push, second attempt"  # rank 0's outcome that asks every rank to gather again
)


class _ShardedRetry(Exception):
    """Rank 0's sharded push failed on some servers and goes again to ``rest`` (every rank joins)."""

    def __init__(self, rest: list[ServerConnection]):
        super().__init__(f"re-send to {[c.url for c in rest]}")
        self.rest = rest


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
        image_wire: ImageWire | None = None,
        min_healthy: int | None = None,
        rotate_servers: bool = False,
        first_server: int = 0,
    ):
        if not connections:
            raise BackendError("ServerBackend needs at least one server connection")
        self.connections = list(connections)
        self.pool = ServerPool(self.connections, min_healthy=min_healthy)
        # Other clients of the same servers in this process (each async actor's): every push outcome
        # reaches their pools too, so a server the push left out is dropped by them as well.
        self.followers: list[ServerPool] = []
        self.collectives = collectives
        self.tokenizer = tokenizer
        self.sync_mode = sync_mode
        self.fallback_to_full = fallback_to_full
        self.bucket_bytes = bucket_bytes
        self.image_wire: ImageWire = image_wire if image_wire is not None else OriginalPng()
        self._version = 0
        self._transports: list[GroupTransport] = []
        self._group_members: list[ServerConnection] = []  # the servers of the open groups, in order
        self._digest_key = b""  # the groups' checksum key, sent with every init (sync.digest)
        self._group_stale = True
        self._groups_failed = False  # a transfer on the open groups failed (see _close_groups)
        self._frozen_synced = False  # frozen weights (training.freeze) already pushed to every server
        self._export_sharded = False  # the last push gathered sharded parameters (ZeRO-3 / FSDP2)
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
        vllm = run.config.rollout.vllm
        if not run.servers:
            raise ConfigError(
                [
                    ConfigProblem(
                        f"{_KEY}.server.servers",
                        None,
                        "server mode needs at least one server entry ({base_url, group_port})",
                    )
                ]
            )
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
        backend._push_v0_over_earlier_weights(model)
        return backend

    # -------------------------------------------------------------------------------- protocol
    @property
    def weight_version(self) -> int:
        return self._version

    def check_compatible(self, local_info: LocalModelInfo) -> None:
        """Refuse to train against a server that serves another model, tokenizer, template or processor
        (``rollout.server_compat``: every mismatch of :func:`local_model_info` with each server's
        ``/info/``), or that cannot take the trainer's sync mode."""
        problems: list[str] = []
        for conn in self.connections:
            info = ServerInfo.model_validate(conn.get("/info/", "start-up cross-check"))
            lines = server_mismatches(local_info, info)
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
        """``barrier -> rank 0 pushes -> every rank gets the outcome`` (a failure raises on every rank).

        Sharded parameters (ZeRO-3 / FSDP2): every rank takes part in each attempt's per-bucket gathers,
        so a push that failed on some servers is re-sent to the rest as a second attempt every rank
        joins (the outcome of the first says so), like a full-weight push's failover."""
        coll = self.collectives
        # the push's start barrier also brings rank 0 the servers each rank's actor found down
        found_down = coll.all_gather_object(
            self.pool.newly_down_in(self.followers), f"weight sync v{version}: before push"
        )
        if coll.is_main:
            self.pool.take_in_found_down(found_down)
        outcome: SyncReport | str | None = None
        failure: Exception | None = None
        rest: list[ServerConnection] | None = None
        started = time.perf_counter()  # sync/seconds: the whole push, probes, group formation and retries
        for attempt in (1, 2):
            outcome, failure = None, None
            if coll.is_main:
                try:
                    pushed = (
                        self._push(model, version) if rest is None else self._push_to(model, version, rest)
                    )
                    outcome = dataclasses.replace(pushed, seconds=time.perf_counter() - started)
                except _ShardedRetry as retry:
                    rest, outcome = retry.rest, _RETRY_SHARDED
                except Exception as exc:  # any cause (a DNS error, a bad answer): every rank must hear it
                    failure, outcome = exc, f"{type(exc).__name__}: {exc}"
            else:  # sharded parameters (ZeRO-3 / FSDP2): take part in rank 0's per-bucket gathers
                SyncTensors(model, self.sync_mode).drain()  # type: ignore[arg-type]
            outcome = coll.broadcast_object(
                outcome, f"weight sync v{version}: after push (attempt {attempt})"
            )
            if outcome != _RETRY_SHARDED:
                break
        if outcome == _RETRY_SHARDED:
            raise SyncError(f"weight push of version {version}: a second failover was asked for; a bug")
        if failure is not None:
            raise failure
        if isinstance(outcome, str):
            raise SyncError(f"rank 0's weight push of version {version} failed: {outcome}")
        self._version = outcome.version
        # Every rank, and every actor's client, uses exactly the servers rank 0 pushed to: the others are
        # down until a later push re-syncs them (rank 0 counted the failover when the push failed).
        why = f"left out of the weight push of version {outcome.version} (its push failed or it is down)"
        for pool in (self.pool, *self.followers):
            pool.learner_pushed(outcome.version, outcome.servers, why, count=False)
        return outcome

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_groups(notify=True)
        for conn in self.connections:
            conn.close()

    def _push_v0_over_earlier_weights(self, model: Any) -> None:
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
        """Push to the healthy servers and to the down ones that answer ``/health/`` again (fresh groups,
        full weights); when that fails on some servers, mark them down and push once more to the rest."""
        targets = self._push_targets()
        try:
            return self._push_to(model, version, targets)
        except RollmatchError as exc:
            failed = self._failed_targets(exc, targets)
            if not failed or len(targets) - len(failed) < self.pool.min_healthy:
                raise  # nothing to go on with
            for conn in failed:
                self.pool.mark_down(conn, f"weight push of version {version} failed: {exc}")
                self.pool.push_failed(conn)
            rest = [conn for conn in targets if conn not in failed]
            if self._export_sharded:  # the other ranks must join the second push's gathers: tell them first
                log.warning(
                    "weight push of version %d failed (%s): sending it again to %s (sharded: every rank gathers again)",
                    version,
                    exc,
                    [c.url for c in rest],
                )
                raise _ShardedRetry(rest) from exc
            log.warning(
                "weight push of version %d failed (%s): sending it again to %s",
                version,
                exc,
                [c.url for c in rest],
            )
            return self._push_to(model, version, rest)

    def _push_targets(self) -> list[ServerConnection]:
        due = [c for c in self.connections if self.pool.is_down(c) and self.pool.resync_due(c)]
        back = self.pool.answering(due)
        if back:
            log.warning("rollout server(s) %s answer again: re-syncing them", [c.url for c in back])
        targets = [c for c in self.connections if not self.pool.is_down(c) or c in back]
        if len(targets) < self.pool.min_healthy:
            self.pool.check_enough()
        if back or targets != self._group_members:
            self._group_stale = True  # a server left or rejoins: fresh groups, every tensor sent
        return targets

    def _failed_targets(self, exc: RollmatchError, targets: list[ServerConnection]) -> list[ServerConnection]:
        """The server a group-formation failure belongs to (typed: :class:`ServerSyncFailure`), else the
        servers a failed push names, or, when it names none, those that stopped answering."""
        cause: BaseException | None = exc
        while cause is not None:
            if isinstance(cause, ServerSyncFailure):
                return [conn for conn in targets if conn.url == cause.server_url]
            cause = cause.__cause__
        text = str(exc)  # a URL followed by more of a host or port is another server's
        named = [conn for conn in targets if re.search(re.escape(conn.url) + r"(?![\w.-])", text)]
        if named:
            return named
        answering = self.pool.answering(targets)
        return [conn for conn in targets if conn not in answering]

    def _push_to(self, model: Any, version: int, targets: list[ServerConnection]) -> SyncReport:
        if self.sync_mode == "adapter":
            try:
                return self._push_mode(model, version, "adapter", targets)
            except SyncError as exc:
                if not self.fallback_to_full:
                    raise SyncError(
                        f"adapter sync failed: {exc}. Set `{_KEY}.sync.fallback_to_full: true` or "
                        f"`{_KEY}.sync.mode: full`"
                    ) from exc
                log.warning("adapter sync failed (%s); using full sync for the rest of the run", exc)
                self.sync_mode = "full"
        return self._push_mode(model, version, "full", targets)

    def _push_mode(self, model: Any, version: int, mode: str, targets: list[ServerConnection]) -> SyncReport:
        if self._group_stale or targets != self._group_members:  # the servers may have restarted
            self._group_stale, self._frozen_synced = True, False  # new groups: send every tensor once
        tensors = SyncTensors(model, mode, skip_frozen=self._frozen_synced)  # type: ignore[arg-type]
        self._export_sharded = tensors.gather is not None
        try:
            if self._group_stale:
                self._open_groups(model, targets)
            adapter = (
                AdapterPayload(peft_adapter_config(model), lora_int_id=version + 1)
                if mode == "adapter"
                else None
            )
            result = push_update(
                list(zip(self._group_members, self._transports, strict=True)),
                tensors,
                version=version,
                mode=mode,  # type: ignore[arg-type]
                digest_key=self._digest_key,
                bucket_bytes=self.bucket_bytes,
                adapter=adapter,
            )
        except Exception:
            self._group_stale = True  # a half-sent bucket leaves the group out of step: rebuild it next time
            self._groups_failed = True  # and a peer may be dead: abort its communicator, never wait on it
            raise
        finally:
            tensors.drain()  # whatever failed, run the gathers other ranks wait in (sharded parameters)
        self._frozen_synced = mode == "full"
        for conn in targets:
            self.pool.admit(conn, version)
        return SyncReport(
            version=version,
            num_bytes=result.num_bytes,
            seconds=result.seconds,
            mode=mode,  # type: ignore[arg-type]
            servers=tuple(conn.url for conn in targets),
        )

    def _open_groups(self, model: Any, targets: list[ServerConnection]) -> None:
        """Close stale groups, then form one private group per server (trainer = last rank), every one
        with the same fresh digest key, so each bucket is digested once."""
        self._close_groups(notify=True)
        device = next(strip_parallel_wrappers(model).parameters()).device
        backend = default_backend(device)
        self._digest_key = new_digest_key()
        for conn in targets:
            try:
                self._open_group(conn, device, backend)
            except Exception as exc:  # whatever the cause names (host:group_port), it is this server's
                raise ServerSyncFailure(
                    conn.url,
                    f"rollout server {conn.url}: forming its weight-sync group failed: "
                    f"{type(exc).__name__}: {exc}",
                ) from exc
        self._group_stale = False

    def _open_group(self, conn: ServerConnection, device: Any, backend: str) -> None:
        """``conn``'s group: ``/init_communicator/``, then the trainer's side (its last rank)."""
        server_ranks = int(conn.get("/get_world_size/", "communicator init")["world_size"])
        group_host = socket.gethostbyname(conn.host)  # the server listens on the address we reach it at
        body = InitCommunicatorBody(
            host=group_host,
            port=conn.group_port,
            world_size=server_ranks + 1,
            backend=backend,
            timeout_s=min(conn.timeout_s, MAX_GROUP_TIMEOUT_S),
            digest_key=self._digest_key.hex(),
        )
        conn.sync_lease = None
        reply = init_reply(conn, conn.post("/init_communicator/", body, "communicator init"))
        if parse_digest_key(reply.digest_key, f"{conn.url} /init_communicator/") != self._digest_key:
            raise SyncError(
                f"rollout server {conn.url}: /init_communicator/ answered another digest key than the trainer "
                "sent; is it a rollmatch server of the same protocol version?"
            )
        conn.sync_lease = reply.lease
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
        self._group_members.append(conn)
        self._group_stale = False

    def _close_groups(self, *, notify: bool) -> None:
        for transport in self._transports:
            transport.close(abort=self._groups_failed)
        self._groups_failed = False
        if notify and self.collectives.is_main:
            for conn in self.connections:
                if conn.sync_lease is None:  # no group of ours there: nothing to close
                    continue
                if self.pool.is_down(conn):  # gone or frozen: its next init replaces the group
                    conn.sync_lease = None
                    continue
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
        self._transports, self._group_members = [], []
        self._group_stale = True
