"""A free TCP port on 127.0.0.1, for tests that start servers, weight-sync groups or torchrun rendezvous.

A module of its own (not ``conftest``) so tests anywhere under tests/ import it by a unique name.
"""

from __future__ import annotations

import socket


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
