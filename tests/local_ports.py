"""Free loopback ports for tests that start servers (test process)."""
from __future__ import annotations

import socket


def free_port_block(size: int) -> int:
    """First of ``size`` consecutive loopback ports that are free right now (per-rank exporters need a block)."""
    for _ in range(50):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            base = int(sock.getsockname()[1])
        if base + size > 65535:
            continue
        try:
            for port in range(base, base + size):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no block of {size} free loopback ports after 50 tries")
