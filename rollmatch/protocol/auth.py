"""The credentials a rollout server and its clients exchange: header names and environment variables.

Owns the one definition of each: the API key (``Authorization: Bearer``, read from
``ROLLMATCH_API_KEY`` by the server, the trainer and ``rollmatch launch``), the weight-sync key
(``X-Rollmatch-Sync-Key``, ``ROLLMATCH_SYNC_KEY``) that ``/init_communicator/`` needs when the server
has one, and the sync lease (``X-Rollmatch-Sync-Lease``) that ``/init_communicator/`` hands out.
Leaves out: where keys come from and how they are checked (``server.gate``,
``server.sync_session``, ``rollout.connection``).
"""

from __future__ import annotations

API_KEY_ENV = "ROLLMATCH_API_KEY"
SYNC_KEY_ENV = "ROLLMATCH_SYNC_KEY"
SYNC_KEY_HEADER = "X-Rollmatch-Sync-Key"
LEASE_HEADER = "X-Rollmatch-Sync-Lease"
