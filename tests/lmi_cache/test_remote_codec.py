"""Remote values (value_codec), settings, backoff and the put queue: the server-free parts of the remote tier."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from remote_fixtures import make_keys, make_object, payload_of

from lmi_cache.keys.chunk_format import ChunkFormatError, ChunkHeader
from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.errors import ConfigError
from lmi_cache.remote.put_queue import PutQueue
from lmi_cache.remote.settings import RemoteSettings
from lmi_cache.remote.url import redact_url
from lmi_cache.remote.store import Backoff
from lmi_cache.remote.value_codec import (
    SECRET_ENV,
    VALUE_HEADER_BYTES,
    DecodedChunk,
    MissReason,
    ValueCodec,
    join_planes,
    load_secret,
    split_planes,
)

KEYS = make_keys(3)
SECRET = b"0123456789abcdef-fleet"
MODES = ["off", "zstd", "zstd-planes"]


def decoded_payload(codec: ValueCodec, value: bytes, key: ChunkKey) -> bytes:
    result = codec.decode(value, key)
    assert isinstance(result, DecodedChunk), result
    return bytes(result.payload)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("secret", [None, SECRET])
def test_round_trip_every_mode(mode: str, secret: bytes | None) -> None:
    codec = ValueCodec(secret, mode)
    obj = make_object(KEYS[0], 8192)
    value = codec.encode(obj)
    assert decoded_payload(codec, value, KEYS[0]) == payload_of(obj)
    if mode != "off":
        assert len(value) < len(obj)  # bf16-like payloads compress


def test_encode_fills_in_a_missing_checksum() -> None:
    codec = ValueCodec()
    obj = make_object(KEYS[0], 1024, checksum=False)
    assert decoded_payload(codec, codec.encode(obj), KEYS[0]) == payload_of(obj)


def test_incompressible_payload_is_stored_plain() -> None:
    payload = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    header = ChunkHeader.for_key(KEYS[0], len(payload), "uint8", (len(payload),))
    codec = ValueCodec(None, "zstd")
    value = codec.encode(header.pack() + payload)
    assert value[5] == 0  # codec byte: none
    assert decoded_payload(codec, value, KEYS[0]) == payload


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("secret", [None, SECRET])
def test_a_flipped_byte_never_yields_wrong_bytes(mode: str, secret: bytes | None) -> None:
    """A flip is a miss, or (compressed, no MAC) a frame-header bit that changes nothing: never wrong bytes."""
    codec = ValueCodec(secret, mode)
    obj = make_object(KEYS[0], 2048)
    value = codec.encode(obj)
    accepted = []
    for offset in range(len(value)):
        damaged = bytearray(value)
        damaged[offset] ^= 0x40
        result = codec.decode(bytes(damaged), KEYS[0])
        if isinstance(result, DecodedChunk):
            assert bytes(result.payload) == payload_of(obj)
            accepted.append(offset)
    if secret or mode == "off":
        assert accepted == []
    # otherwise a flip inside zstd's frame header may be harmless: the bytes were checked above


def test_miss_reasons() -> None:
    codec = ValueCodec()
    value = codec.encode(make_object(KEYS[0], 2048))
    assert codec.decode(None, KEYS[0]) == MissReason.NOT_FOUND
    assert codec.decode(b"hello world", KEYS[0]) == MissReason.FOREIGN
    assert codec.decode(b"", KEYS[0]) == MissReason.TRUNCATED
    assert codec.decode(value[:-1], KEYS[0]) == MissReason.TRUNCATED
    assert codec.decode(value[:30], KEYS[0]) == MissReason.TRUNCATED
    assert codec.decode(value + b"x", KEYS[0]) == MissReason.CORRUPTED
    future = bytearray(value)
    future[4] = 9  # a later value-format version
    assert codec.decode(bytes(future), KEYS[0]) == MissReason.FOREIGN
    # a valid value found under another chunk's key
    assert codec.decode(value, KEYS[1]) == MissReason.CORRUPTED
    # same digest, other tokens (a digest collision): the fingerprint catches it
    twin = ChunkKey(KEYS[0].digest, KEYS[0].start, KEYS[0].end, KEYS[0].fingerprint ^ 1)
    assert codec.decode(value, twin) == MissReason.FINGERPRINT


def test_payload_damage_without_mac_is_caught_by_the_checksum() -> None:
    codec = ValueCodec()
    value = bytearray(codec.encode(make_object(KEYS[0], 2048)))
    value[-5] ^= 1
    assert codec.decode(bytes(value), KEYS[0]) == MissReason.CORRUPTED


def test_mac_on_and_off() -> None:
    signed = ValueCodec(SECRET).encode(make_object(KEYS[0], 1024))
    plain = ValueCodec().encode(make_object(KEYS[0], 1024))
    assert isinstance(ValueCodec(SECRET).decode(signed, KEYS[0]), DecodedChunk)
    assert ValueCodec(SECRET).decode(plain, KEYS[0]) == MissReason.MAC_MISSING
    assert ValueCodec(b"another-secret-of-the-fleet").decode(signed, KEYS[0]) == MissReason.MAC_INVALID
    # without a secret, signed values are still verified by their checksums and accepted
    assert isinstance(ValueCodec().decode(signed, KEYS[0]), DecodedChunk)


def test_a_writer_without_the_secret_cannot_forge_a_value() -> None:
    """Valid chunk, valid checksum, MAC flag set but the MAC made up: refused."""
    plain = bytearray(ValueCodec().encode(make_object(KEYS[0], 1024)))
    plain[6] = 1  # claims a MAC
    plain[VALUE_HEADER_BYTES - 32 : VALUE_HEADER_BYTES] = b"\x11" * 32
    assert ValueCodec(SECRET).decode(bytes(plain), KEYS[0]) == MissReason.MAC_INVALID


def test_compressed_value_claiming_a_small_size_cannot_expand() -> None:
    """A forged size field: decompression is bounded by the chunk header's payload size."""
    codec = ValueCodec(None, "zstd")
    value = bytearray(codec.encode(make_object(KEYS[0], 8192)))
    struct.pack_into("<Q", value, 8, 100)  # uncompressed payload bytes
    assert codec.decode(bytes(value), KEYS[0]) == MissReason.CORRUPTED


def test_reader_without_zstd_settings_decodes_compressed_values() -> None:
    value = ValueCodec(None, "zstd-planes").encode(make_object(KEYS[2], 4096))
    assert decoded_payload(ValueCodec(), value, KEYS[2]) == payload_of(make_object(KEYS[2], 4096))


@settings(max_examples=50, deadline=None)
@given(data=st.binary(max_size=512), elem_bytes=st.sampled_from([2, 4]))
def test_byte_planes_round_trip(data: bytes, elem_bytes: int) -> None:
    data = data[: len(data) - len(data) % elem_bytes]
    assert bytes(join_planes(split_planes(data, elem_bytes), elem_bytes)) == data


def test_secret_from_environment() -> None:
    assert load_secret({}) is None
    assert load_secret({SECRET_ENV: "x" * 32}) == b"x" * 32
    with pytest.raises(ConfigError, match=SECRET_ENV):
        load_secret({SECRET_ENV: "short"})


def test_unknown_compression_is_refused() -> None:
    with pytest.raises(ConfigError, match="brotli"):
        ValueCodec(None, "brotli")


# ------------------------------------------------------------ settings
@pytest.mark.parametrize("url", ["redis://h:6379", "rediss://h:6380/2", "valkey://h", "valkeys://u:p@h:1",
                                 "unix:///run/redis.sock"])
def test_redis_urls(url: str) -> None:
    assert RemoteSettings(url).kind == "redis"


def test_s3_url() -> None:
    settings = RemoteSettings("s3://bucket/a/b/")
    assert settings.kind == "s3" and settings.remote_url.s3_location() == ("bucket", "a/b")


@pytest.mark.parametrize("url,message", [("http://h", "unsupported scheme"), ("redis://:6379", "no host"),
                                         ("redis://h:99999", "bad port"), ("s3://", "needs a bucket"),
                                         ("unix://", "socket path")])
def test_bad_urls(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RemoteSettings(url)


def test_credentials_never_shown() -> None:
    settings = RemoteSettings("rediss://admin:hunter2-secret@cache:6380/0")
    assert "hunter2" not in settings.display_url and "admin" not in settings.display_url
    assert settings.display_url == "rediss://***@cache:6380/0"
    with pytest.raises(ConfigError) as info:
        RemoteSettings("redis://admin:hunter2-secret@cache:bad")
    assert "hunter2" not in str(info.value)
    assert redact_url("redis://cache:6379") == "redis://cache:6379"


def test_valkey_scheme_and_cluster_option() -> None:
    settings = RemoteSettings("valkeys://cache:6380/0?cluster=true")
    assert settings.wants_cluster
    assert settings.remote_url.redis_client_url() == "rediss://cache:6380/0"
    assert not RemoteSettings("redis://cache").wants_cluster
    assert RemoteSettings("redis://cache", cluster=True).wants_cluster


def test_lossy_serde_refused_naive_accepted() -> None:
    assert RemoteSettings("redis://h", serde="naive").serde == "naive"
    with pytest.raises(ConfigError, match="lossy"):
        RemoteSettings("redis://h", serde="cachegen")
    with pytest.raises(ConfigError, match="unknown"):
        RemoteSettings("redis://h", serde="pickle")


@pytest.mark.parametrize("field,value", [("lookup_timeout_ms", 0), ("put_queue_bytes", -1), ("ttl_s", -5),
                                         ("key_prefix", "a b"), ("compression", "lz5")])
def test_bad_settings_name_the_setting(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field.split("_")[0]):
        RemoteSettings("redis://h", **{field: value})  # type: ignore[arg-type]


def test_encode_refuses_an_object_of_another_key() -> None:
    obj = make_object(KEYS[0], 512)
    assert ValueCodec().encode(obj, KEYS[0])
    with pytest.raises(ChunkFormatError, match="belong"):
        ValueCodec().encode(obj, KEYS[1])


def test_backoff_lets_one_probe_through_per_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    import lmi_cache.remote.store as store_module

    now = [100.0]
    monkeypatch.setattr(store_module.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(store_module.random, "uniform", lambda a, b: 1.0)
    backoff = Backoff(initial_s=0.5, max_s=1.5)
    assert backoff.allow() and backoff.failed()  # the first failure opens it (True: it was up)
    assert not backoff.allow()
    now[0] += 0.6
    assert backoff.allow()  # one probe ...
    assert not backoff.allow()  # ... and only one
    assert not backoff.failed()  # the probe failed (not a new outage): the delay doubles to 1.0
    now[0] += 0.6
    assert not backoff.allow()
    now[0] += 0.5
    assert backoff.allow()
    backoff.failed()
    backoff.failed()  # capped at 1.5
    now[0] += 1.6
    assert backoff.allow()
    assert backoff.succeeded() and backoff.allow() and backoff.allow() and backoff.reconnects == 1


def test_put_queue_writer_survives_a_raising_callback() -> None:
    written: list[int] = []

    def write(batch: list) -> None:
        if not written:
            written.append(-1)
            raise RuntimeError("boom")
        written.append(len(batch))

    queue = PutQueue(write, max_bytes=1 << 20)
    try:
        keys = make_keys(2)
        assert queue.offer(keys[0], make_object(keys[0], 64)) is None
        assert queue.flush(5)
        assert queue.offer(keys[1], make_object(keys[1], 64)) is None
        assert queue.flush(5) and written == [-1, 1]
        assert queue.offer(keys[1], b"x" * (2 << 20)) == "queue_full"
    finally:
        assert queue.close() == 0
    assert queue.offer(keys[0], b"x") == "closed"
