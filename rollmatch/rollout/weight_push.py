"""Weight pushes to rollout servers: the learner's rank 0 sends its weights to every server it uses.

Owns: :class:`WeightPushCoordinator`, the trainer's side of in-memory weight sync with one or more
``rollmatch serve`` servers: the ranks' protocol (``barrier -> rank 0 pushes -> every rank hears the
outcome``), which servers a push goes to, one private weight-sync group per server (formed, kept and
closed here), the adapter-to-full fallback, and the push failover. Leaves out: the transaction itself
(``sync.transaction``, which raises :class:`~rollmatch.errors.ServerPushFailed` naming the server and
the phase a push failed at), the group (``sync.transport``), which tensors go (``sync.weights``),
server health (``rollout.server_pool``) and rollouts (``rollout.client``).

Failover: a push goes to the healthy servers and to the down ones that answer ``/health/`` again
(fresh groups, full weights). When it fails at some servers (the ``url`` of the
:class:`~rollmatch.errors.ServerPushFailed` it raised; a failure that names no server: those that no
longer answer ``/health/``), they are marked down and the push is sent again, once, to the rest, while
at least ``vllm.server.min_healthy`` stay up. With sharded parameters (ZeRO-3 / FSDP2) every rank
takes part in each attempt's per-bucket gathers, so rank 0's outcome of a first attempt tells every
rank to gather again for the second.

Multi-process learners: every rank calls :meth:`WeightPushCoordinator.sync_weights`; only rank 0
opens the groups and pushes, so no rank generates with stale weights and a failed push fails every
rank. Every push outcome also reaches the async actors' pools (``followers``).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollmatch.collectives import Collectives
from rollmatch.errors import BackendError, RollmatchError, ServerPushFailed, SyncError
from rollmatch.models.wrappers import strip_parallel_wrappers
from rollmatch.protocol import MAX_GROUP_TIMEOUT_S, InitCommunicatorBody, ServerInfo
from rollmatch.rollout.connection import KEY, ServerConnection
from rollmatch.rollout.replies import init_reply
from rollmatch.rollout.server_pool import ServerPool
from rollmatch.rollout.types import SyncReport
from rollmatch.sync.digest import new_digest_key, parse_digest_key
from rollmatch.sync.transaction import AdapterPayload, push_update
from rollmatch.sync.transport import GroupTransport, default_backend
from rollmatch.sync.weights import SyncTensors, peft_adapter_config

__all__ = ["WeightPushCoordinator"]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _SendAgain:
    """Rank 0's outcome of a sharded push's first attempt that failed at some servers: every rank
    gathers again for the second attempt, to ``servers`` (urls)."""

    servers: tuple[str, ...]


class _ShardedRetry(Exception):
    """Rank 0's sharded push failed at some servers and goes again to ``rest`` (every rank joins)."""

    def __init__(self, rest: list[ServerConnection]):
        super().__init__(f"re-send to {[c.url for c in rest]}")
        self.rest = rest


class WeightPushCoordinator:
    """Pushes the learner's weights to its rollout servers (see the module docstring)."""

    def __init__(
        self,
        connections: Sequence[ServerConnection],
        pool: ServerPool,
        *,
        collectives: Collectives,
        sync_mode: str = "full",
        fallback_to_full: bool = True,
        bucket_bytes: int = 64 << 20,
    ):
        self.connections = list(connections)
        self.pool = pool
        # Other clients of the same servers in this process (each async actor's): every push outcome
        # reaches their pools too, so a server the push left out is dropped by them as well.
        self.followers: list[ServerPool] = []
        self.collectives = collectives
        self.sync_mode = sync_mode
        self.fallback_to_full = fallback_to_full
        self.bucket_bytes = bucket_bytes
        self.version = 0  # the weight version the servers serve (the last completed push's)
        self._transports: list[GroupTransport] = []
        self._group_members: list[ServerConnection] = []  # the servers of the open groups, in order
        self._digest_key = b""  # the groups' checksum key, sent with every init (sync.digest)
        self._group_stale = True
        self._groups_failed = False  # a transfer on the open groups failed (see _close_groups)
        self._frozen_synced = False  # frozen weights (training.freeze) already pushed to every server
        self._export_sharded = False  # the last push gathered sharded parameters (ZeRO-3 / FSDP2)

    def sync_weights(self, model: Any, version: int) -> SyncReport:
        """``barrier -> rank 0 pushes -> every rank gets the outcome`` (a failure raises on every rank:
        rank 0's own error, a :class:`SyncError` quoting it on the others)."""
        coll = self.collectives
        # the push's start barrier also brings rank 0 the servers each rank's actor found down
        found_down = coll.all_gather_object(
            self.pool.newly_down_in(self.followers), f"weight sync v{version}: before push"
        )
        if coll.is_main:
            self.pool.take_in_found_down(found_down)
        outcome: SyncReport | _SendAgain | str | None = None
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
                    rest, outcome = retry.rest, _SendAgain(tuple(c.url for c in retry.rest))
                except Exception as exc:  # any cause (a DNS error, a bad answer): every rank must hear it
                    failure, outcome = exc, f"{type(exc).__name__}: {exc}"
            else:  # sharded parameters (ZeRO-3 / FSDP2): take part in rank 0's per-bucket gathers
                SyncTensors(model, self.sync_mode).drain()  # type: ignore[arg-type]
            outcome = coll.broadcast_object(
                outcome, f"weight sync v{version}: after push (attempt {attempt})"
            )
            if not isinstance(outcome, _SendAgain):
                break
        if isinstance(outcome, _SendAgain):
            raise SyncError(f"weight push of version {version}: a second failover was asked for; a bug")
        if failure is not None:
            raise failure
        if not isinstance(outcome, SyncReport):
            raise SyncError(f"rank 0's weight push of version {version} failed: {outcome}")
        self.version = outcome.version
        # Every rank, and every actor's client, uses exactly the servers rank 0 pushed to: the others are
        # down until a later push re-syncs them (rank 0 counted the failover when the push failed).
        why = f"left out of the weight push of version {outcome.version} (its push failed or it is down)"
        for pool in (self.pool, *self.followers):
            pool.learner_pushed(outcome.version, outcome.servers, why, count=False)
        return outcome

    def push_v0_over_earlier_weights(self, model: Any) -> None:
        """A server that already serves pushed weights (an earlier run) first gets the trainer's as v0
        (a push every rank joins)."""
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

    def close(self) -> None:
        """Close the groups (and tell the servers that still answer)."""
        self._close_groups(notify=True)

    # --------------------------------------------------------------------------------- rank 0
    def _push(self, model: Any, version: int) -> SyncReport:
        """Push to the healthy servers and to the down ones that answer ``/health/`` again (fresh groups,
        full weights); when that fails at some servers, mark them down and push once more to the rest."""
        targets = self._push_targets()
        try:
            return self._push_to(model, version, targets)
        except RollmatchError as exc:
            failed = self._failed_servers(exc, targets)
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

    def _failed_servers(self, exc: BaseException, targets: list[ServerConnection]) -> list[ServerConnection]:
        """The server a failed push names (its :class:`ServerPushFailed`, also behind a wrapping error),
        or, when the failure is no server's, those that stopped answering ``/health/``."""
        cause: BaseException | None = exc
        while cause is not None:
            if isinstance(cause, ServerPushFailed):
                return [conn for conn in targets if conn.url == cause.url]
            cause = cause.__cause__
        answering = self.pool.answering(targets)
        return [conn for conn in targets if conn not in answering]

    def _push_to(self, model: Any, version: int, targets: list[ServerConnection]) -> SyncReport:
        if self.sync_mode == "adapter":
            try:
                return self._push_mode(model, version, "adapter", targets)
            except SyncError as exc:
                if isinstance(exc, ServerPushFailed) and not exc.refused:
                    raise  # a server that stopped answering: the failover's business, not full weights'
                if not self.fallback_to_full:
                    raise SyncError(
                        f"adapter sync failed: {exc}. Set `{KEY}.sync.fallback_to_full: true` or "
                        f"`{KEY}.sync.mode: full`"
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
                raise ServerPushFailed(conn.url, "group", exc) from exc
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
