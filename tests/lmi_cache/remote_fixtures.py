"""Fixtures of the remote-tier tests: own redis-server processes and a moto S3 server on loopback.

Imported by tests/lmi_cache/test_remote_*.py (``from remote_fixtures import ...``).
Every server is started here on a port picked here and stopped at the end;
no test touches a port it did not start.
"""
from __future__ import annotations

import os
from typing import Iterator

import numpy as np
import pytest

from tests.moto_server import moto_endpoint

from lmi_cache.keys.chunk_format import ChunkHeader
from lmi_cache.keys.hashing import ChunkKey, KeyNamespace, chunk_keys
from lmi_cache.devtools.redis_server import RedisServer
from lmi_cache.remote.settings import RemoteSettings

BUCKET = "kv-bucket"
CHUNK_TOKENS = 16


def make_keys(num: int, model: str = "m", seed: int = 0) -> list[ChunkKey]:
    tokens = np.random.default_rng(seed).integers(0, 30000, size=num * CHUNK_TOKENS)
    return chunk_keys(tokens, KeyNamespace(model, "bfloat16", "test-v1"), CHUNK_TOKENS)


def make_object(key: ChunkKey, num_bytes: int = 4096, seed: int = 0, checksum: bool = True,
                dtype: str = "bfloat16") -> bytes:
    """A chunk object whose payload looks like bf16 KV (small normal values): compressible like the real thing."""
    values = np.random.default_rng(seed).normal(0, 1, size=num_bytes // 2).astype(np.float32)
    payload = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()  # bf16 by truncation
    shape = (len(payload) // 2,) if dtype == "bfloat16" else (len(payload),)
    header = ChunkHeader.for_key(key, len(payload), dtype, shape)
    if checksum:
        header = header.with_checksum(payload)
    return header.pack() + payload


def payload_of(obj: bytes) -> bytes:
    return obj[128:]


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """One shared redis-server for tests that do not break it (each test uses its own key prefix)."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server a test may pause, kill and restart."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def moto_s3() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 with bucket BUCKET; yields its endpoint URL."""
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    import boto3

    with moto_endpoint() as endpoint:
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        yield endpoint
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def redis_settings(url: str, prefix: str, **overrides: object) -> RemoteSettings:
    options: dict[str, object] = dict(lookup_timeout_ms=200, io_timeout_ms=500, backoff_initial_s=0.2,
                                      backoff_max_s=1.0)
    options.update(overrides)
    return RemoteSettings(url=url, key_prefix=prefix, **options)  # type: ignore[arg-type]


def make_tls_files(directory: str) -> tuple[str, str, str]:
    """A throwaway CA and a server certificate for 127.0.0.1 (openssl CLI): (cert, key, CA cert)."""
    import subprocess

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    d = directory
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=lmi-cache test CA",
        "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.crt")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", f"{d}/server.key",
        "-out", f"{d}/server.csr")
    with open(f"{d}/san.ext", "w") as ext:
        ext.write("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", f"{d}/server.csr", "-CA", f"{d}/ca.crt", "-CAkey", f"{d}/ca.key", "-CAcreateserial",
        "-days", "1", "-extfile", f"{d}/san.ext", "-out", f"{d}/server.crt")
    return f"{d}/server.crt", f"{d}/server.key", f"{d}/ca.crt"
