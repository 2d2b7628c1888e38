"""A peer in its own process for tests that kill it: serves N chunks of one rank, prints its init port (test helper).

Run: ``python peer_process.py NUM_CHUNKS PAYLOAD_VALUES``; keys are ``test_peer.key_of(1..N)``.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_peer import IDENTITY, Holder, key_of, make_object  # noqa: E402

from lmi_cache.peer.server import PeerServer  # noqa: E402
from lmi_cache.peer.transport import PeerTransport  # noqa: E402


def main() -> None:
    num_chunks, num_values = int(sys.argv[1]), int(sys.argv[2])
    holder = Holder()
    for number in range(1, num_chunks + 1):
        holder.objects[key_of(number).digest] = make_object(number, num_values)
    server = PeerServer(IDENTITY, PeerTransport("127.0.0.1"), holder, host="127.0.0.1", init_port=0, lookup_port=0)
    print(server.init_port, flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
