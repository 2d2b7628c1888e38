"""A moto AWS server on 127.0.0.1 for tests (S3, SageMaker): started on a free port, stopped at the end."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def moto_endpoint() -> Iterator[str]:
    """Yield the endpoint URL of a fresh moto server that this test owns."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()
