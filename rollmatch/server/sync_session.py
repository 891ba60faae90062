"""The server's side of weight sync: who may form the group, its lease and digest key, staged updates.

Owns: :class:`SyncSession`. Weight sync is administration, apart from generation: with a *sync key*
(``rollmatch serve --sync-key-file``), ``/init_communicator/`` needs it (``X-Rollmatch-Sync-Key``;
403 without), so a client that holds only the API key can generate but never form the group. An
init starts forming the group in the background and hands out a *sync lease* and the *digest key*
that keys the update's checksums (``sync.digest``); every bucket, finish and close must carry the
lease (``X-Rollmatch-Sync-Lease``), so only the trainer that formed the current group can push or
close it (a close while no lease is held is a no-op). A later ``/init_communicator/`` (a restarted
trainer) cancels a pending init and replaces the group, the lease and the key; the previous holder
then gets a 409 naming why. ``/close_communicator/`` cancels a pending init too. Versions: within
one group they never go back (a bucket 0 of a version below the group's last loaded one is a 409;
the same version may be sent again), and a new group whose first update goes below the version
served before is logged as such, since a new trainer run starts again at 0. The group listens only
on the interface the request names (never on all interfaces), and every wait is bounded: the
rendezvous by the request's ``timeout_s`` (at most ``MAX_GROUP_TIMEOUT_S``), and an update whose
sender goes quiet for that long is abandoned: logged, counted, and its buckets freed.
Leaves out: loading verified weights into the engine (``server.rollout_server``) and HTTP.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable

from rollmatch.errors import CollectiveTimeoutError, RollmatchError, SyncError
from rollmatch.protocol import (
    LEASE_HEADER,
    SYNC_KEY_HEADER,
    FinishUpdateBody,
    InitCommunicatorBody,
    InitCommunicatorReply,
    TransactionHeader,
    UpdateAdapterBody,
    UpdateFlattenedParamsBody,
)
from rollmatch.sync.digest import new_digest_key
from rollmatch.sync.transaction import AdapterPayload, UpdateReceiver, VerifiedUpdate
from rollmatch.sync.transport import GroupCancelled, GroupTransport, bind_listener

log = logging.getLogger(__name__)
_REAP_EVERY_S = 1.0
_CANCEL_JOIN_S = 5.0


class SyncKeyRefused(SyncError):
    """``/init_communicator/`` without the server's sync key (a 403: the caller may generate, not sync)."""


class SyncSession:
    """Communicator state of one rollout server (see the module docstring); thread-safe.

    ``sync_key``: the key ``/init_communicator/`` needs (``None``: every caller that passed the API
    key may form the group)."""

    def __init__(self, receiving_ranks: int, adapter_modes: bool, sync_key: str | None = None):
        self.receiving_ranks = receiving_ranks
        self.adapter_modes = adapter_modes
        self._sync_key = sync_key.encode() if sync_key else None
        self._lock = threading.Lock()
        self._generation = 0  # bumped by every init and close; a stale init thread discards its group
        self._lease: str | None = None
        self._digest_key = b""
        self._group_version: int | None = None  # the last version this group loaded
        self._served_version: int | None = None  # the last version any group loaded
        self._lease_note = "no init_communicator yet"
        self._idle_limit_s = 0.0
        self._transport: GroupTransport | None = None
        self._receiver: UpdateReceiver | None = None
        self._init_thread: threading.Thread | None = None
        self._cancel: threading.Event | None = None
        self._init_error: str | None = None
        self.failed_pushes = 0
        self.abandoned_pushes = 0
        self._stopped = threading.Event()
        threading.Thread(target=self._reap_forever, name="sync-reaper", daemon=True).start()

    # ----------------------------------------------------------------------------------- group
    def init(
        self, body: InitCommunicatorBody, requester: str, sync_key: str | None = None
    ) -> InitCommunicatorReply:
        """Start forming the group (the trainer joins right after this returns); returns the lease and
        the digest key. ``sync_key``: the request's ``X-Rollmatch-Sync-Key``."""
        self.check_sync_key(sync_key)
        expected = self.receiving_ranks + 1
        if body.world_size != expected:
            raise SyncError(
                f"init_communicator world_size {body.world_size}: this server has {self.receiving_ranks} "
                f"receiving rank(s), so the group has {expected} (trainer = last rank)"
            )
        self._cancel_pending()
        with self._lock:
            self._close_locked("replaced by a new init_communicator")
            try:
                listener = bind_listener(body.host, body.port)  # fails here, as a 4xx, not in the thread
            except OSError as exc:
                raise SyncError(f"init_communicator: {exc}") from exc
            self._generation += 1
            self._lease = secrets.token_hex(16)
            self._digest_key = bytes.fromhex(body.digest_key) if body.digest_key else new_digest_key()
            self._group_version = None
            self._lease_note = f"held by the trainer at {requester} since {time.strftime('%H:%M:%S')}"
            self._idle_limit_s = body.timeout_s
            self._init_error = None
            self._cancel = threading.Event()
            self._init_thread = threading.Thread(
                target=self._form_group,
                args=(body, listener, self._cancel, self._generation, self._digest_key),
                name="sync-init",
                daemon=True,
            )
            self._init_thread.start()
            return InitCommunicatorReply(
                message="initializing communicator", lease=self._lease, digest_key=self._digest_key.hex()
            )

    def close(self, lease: str | None) -> bool:
        """Cancel a pending init and drop the group; needs the current lease while one is held (a 409
        otherwise). Returns False when no lease was held (nothing to close: closing is idempotent)."""
        if self._lease is None:
            return False
        self._check_lease(lease)
        self._drop("released by /close_communicator/")
        return True

    def _drop(self, note: str) -> None:
        self._cancel_pending()
        with self._lock:
            self._generation += 1
            self._close_locked("the communicator was closed")
            self._lease, self._lease_note, self._digest_key = None, note, b""

    def _form_group(
        self,
        body: InitCommunicatorBody,
        listener: socket.socket,
        cancel: threading.Event,
        generation: int,
        digest_key: bytes,
    ) -> None:
        device = "cuda" if body.backend == "nccl" else "cpu"
        try:
            transport = GroupTransport(
                host=body.host,
                port=body.port,
                rank=0,
                world_size=body.world_size,
                backend=body.backend,
                timeout_s=body.timeout_s,
                device=device,
                listener=listener,
                cancel=cancel,
            )
        except GroupCancelled:
            log.info("weight-sync group on %s:%d: pending init cancelled", body.host, body.port)
            return
        except RollmatchError as exc:
            with self._lock:
                if generation == self._generation:
                    self._init_error = str(exc)
            log.error("weight-sync group failed: %s", exc)
            return
        with self._lock:
            if generation != self._generation:  # closed or replaced while forming
                transport.close()
                return
            self._transport = transport
            self._receiver = UpdateReceiver(
                transport,
                source_rank=body.world_size - 1,
                digest_key=digest_key,
                device=device,
                on_abandon=self._abandoned,
            )

    def _cancel_pending(self) -> None:
        thread, cancel = self._init_thread, self._cancel
        if thread is not None and cancel is not None and thread.is_alive():
            cancel.set()
            thread.join(timeout=_CANCEL_JOIN_S)  # the waiting loop polls every 50 ms

    def _close_locked(self, why: str) -> None:
        if self._receiver is not None:
            self._receiver.close()
        if self._transport is not None:
            self._transport.close()
        self._transport, self._receiver = None, None
        log.debug("weight-sync group closed: %s", why)

    # --------------------------------------------------------------------------------- updates
    def receive_bucket(self, body: UpdateFlattenedParamsBody | UpdateAdapterBody, lease: str | None) -> None:
        if body.transaction is None:
            raise SyncError(
                "weight updates need a `transaction` header (version, mode, bucket_index, num_bytes) and end with "
                "POST /finish_weight_update/; untracked swift-style updates are not accepted"
            )
        adapter = None
        if isinstance(body, UpdateAdapterBody):
            if not self.adapter_modes:
                raise SyncError("this engine does not serve adapters; use sync.mode: full")
            adapter = AdapterPayload(peft_config=body.peft_config, lora_int_id=body.lora_int_id)
        receiver = self._ready_receiver(lease)
        header = body.transaction
        last = self._group_version
        if header.bucket_index == 0 and last is not None and header.version < last:
            raise SyncError(
                f"weight version {header.version} refused: this trainer's group already loaded version {last}, "
                "and the versions of one group never go back; a new run starts with a new group "
                "(POST /init_communicator/)"
            )
        with self._lock:
            receiver.receive_bucket(header, body.metadatas, adapter)

    def finish(
        self, body: FinishUpdateBody, lease: str | None, load: Callable[[VerifiedUpdate], None]
    ) -> str | None:
        """Verify the staged update and ``load`` it. Returns ``None`` when loaded, or why the update was
        rejected (counted as a failed push; the server keeps its weights). A request without the lease
        or without a group raises ``SyncError`` instead (nothing was attempted)."""
        receiver = self._ready_receiver(lease)
        with self._lock:
            try:
                load(receiver.finish(body))
            except (SyncError, CollectiveTimeoutError) as exc:
                self.failed_pushes += 1
                log.error("weight version %s rejected: %s", body.version, exc)
                return str(exc)
            served, self._served_version, self._group_version = (
                self._served_version,
                body.version,
                body.version,
            )
        if served is not None and body.version < served:
            log.warning(
                "weight version went back from %d to %d: a new trainer group (lease %s) replaced the one that "
                "pushed %d",
                served,
                body.version,
                self._lease_note,
                served,
            )
        return None

    def _ready_receiver(self, lease: str | None) -> UpdateReceiver:
        self._check_lease(lease)
        thread = self._init_thread
        if thread is not None:
            thread.join(timeout=30.0)  # the trainer joined already; this is the last handshake step
        if self._receiver is None:
            reason = self._init_error or "no communicator: POST /init_communicator/ first"
            raise SyncError(f"weight update refused: {reason}")
        return self._receiver

    def check_sync_key(self, given: str | None) -> None:
        """Refuse (``SyncKeyRefused``: a 403) an init without the server's sync key, when it has one;
        compared in constant time, as bytes (a header is latin-1 text), never echoed."""
        if self._sync_key is None:
            return
        try:
            given_bytes = None if given is None else given.encode("latin-1")
        except UnicodeEncodeError:  # not from an HTTP header; no key has such characters
            given_bytes = b""
        if given_bytes is not None and hmac.compare_digest(given_bytes, self._sync_key):
            return
        raise SyncKeyRefused(
            f"{'missing' if given is None else 'wrong'} sync key: forming the weight-sync group needs "
            f"`{SYNC_KEY_HEADER}: <key>` with the key the server was started with (rollmatch serve "
            "--sync-key-file); the API key alone allows generation, not weight sync"
        )

    def check_lease(self, lease: str | None) -> None:
        """Refuse (``SyncError``: a 409) unless ``lease`` is the current lease: the HTTP layer checks
        it before reading a weight-sync body."""
        self._check_lease(lease)

    def _check_lease(self, lease: str | None) -> None:
        """Refuse (``SyncError``: a 409) unless ``lease`` is the current lease. A header arrives as any
        latin-1 text and ``compare_digest`` raises on non-ASCII ``str``, so the lease is compared as
        bytes; a non-ASCII lease is refused as malformed (its value is never echoed)."""
        current = self._lease
        if lease is None:
            given = "no"
        elif not lease.isascii():
            given = "a malformed (non-ASCII)"
        elif current is not None and secrets.compare_digest(lease.encode("ascii"), current.encode("ascii")):
            return
        else:
            given = "another"
        raise SyncError(
            f"weight sync refused: the request carries {given} sync lease ({LEASE_HEADER}); only the "
            f"trainer that formed the current group may push or close it, sending the lease "
            f"/init_communicator/ returned (lease {self._lease_note})"
        )

    # ------------------------------------------------------------------------------ abandoned
    def _abandoned(self, header: TransactionHeader, why: str) -> None:
        self.failed_pushes += 1
        self.abandoned_pushes += 1
        log.warning(
            "weight update of version %d (%s) abandoned after bucket %d: %s; its staged buckets were freed "
            "and the server keeps its current weights",
            header.version,
            header.mode,
            header.bucket_index,
            why,
        )

    def _reap_forever(self) -> None:
        while not self._stopped.wait(_REAP_EVERY_S):
            with self._lock:
                if self._receiver is not None:
                    self._receiver.release_idle(self._idle_limit_s)

    # ---------------------------------------------------------------------------------- facts
    def describe(self) -> str:
        if self._receiver is not None:
            return "ready"
        if self._init_thread is not None and self._init_thread.is_alive():
            return "initializing"
        return f"failed: {self._init_error}" if self._init_error else "none"

    def shutdown(self) -> None:
        self._stopped.set()
        self._drop("the server shut down")
