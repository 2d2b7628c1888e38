"""Redis / Valkey remote store over redis-py, single node or cluster (vLLM worker process).

``exists_many`` is one round trip of pipelined EXISTS per name (a multi-key
EXISTS only counts); ``fetch_many_into`` reads values in consecutive MGETs of
about 8 MiB of reply each (``MGET_REPLY_BYTES``; cluster mode: redis-py's
MGET, split by node), and ``upload_many`` is a pipelined SET [EX ttl]. Two clients with their own socket timeouts
keep a slow bulk transfer from delaying lookups. redis-py's own retries are
off: ``RemoteCache`` decides when to try again (``Backoff``), so no call
blocks longer than its socket timeout. Clients are built on first use, so a
store that is down at start costs a miss, not a failed start.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable, Sequence

from lmi_cache.errors import ConfigError
from lmi_cache.remote.settings import PASSWORD_ENV, USERNAME_ENV, RemoteSettings
from lmi_cache.remote.resp_reply import BulkArrayReader, ReplyError
from lmi_cache.remote.store import BodyAllocator, ReceivedValue, RemoteStore, StoreError


def _import_redis() -> Any:
    try:
        import redis
    except ImportError:
        raise ConfigError(
            "remote_url is a Redis/Valkey URL but the redis package is missing; pip install 'lmi-cache[remote]'"
        ) from None
    return redis


# A batch is read as consecutive MGETs whose replies are about this size, one round trip after
# another on one connection. redis-server 7.0 sends a reply of tens of MiB far slower than several
# smaller ones (loopback, 124 MiB per batch: one MGET of 31 x 4 MiB values 74 ms, MGETs of 2 of them
# 29 ms; 1 MiB values 79 ms vs 27 ms in MGETs of 8; 256 KiB values 93 ms vs 42-45 ms in MGETs of
# 16-64), and pipelining the MGETs brings the one big reply back: ``benchmarks/bench_tier_reads.py``
# (its MGET sizes table).
MGET_REPLY_BYTES = 8 << 20


class RedisStore(RemoteStore):
    name = "redis"

    def __init__(self, settings: RemoteSettings) -> None:
        super().__init__(settings.key_prefix)
        self._redis = _import_redis()
        self._url = settings.remote_url.redis_client_url()
        self._cluster = settings.wants_cluster
        self._ttl_s = settings.ttl_s or None
        self._lookup_timeout_s = settings.lookup_timeout_ms / 1000
        self._io_timeout_s = settings.io_timeout_ms / 1000
        self._credentials: dict[str, str] = {}
        if os.environ.get(PASSWORD_ENV) and "@" not in self._url.split("//", 1)[-1].split("/", 1)[0]:
            self._credentials["password"] = os.environ[PASSWORD_ENV]
            if os.environ.get(USERNAME_ENV):
                self._credentials["username"] = os.environ[USERNAME_ENV]
        self._secrets = [s for s in (self._credentials.get("password"), settings.remote_url.password) if s]
        self._lock = threading.Lock()
        self._lookup_client: Any = None
        self._io_client: Any = None
        self._value_bytes = 0  # size of the values the latest MGET returned (sizes the next MGETs)

    # ------------------------------------------------------------ clients
    def _client(self, lookup: bool) -> Any:
        with self._lock:
            client = self._lookup_client if lookup else self._io_client
            if client is None:
                client = self._build(self._lookup_timeout_s if lookup else self._io_timeout_s)
                if lookup:
                    self._lookup_client = client
                else:
                    self._io_client = client
            return client

    def _build(self, timeout_s: float) -> Any:
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        options: dict[str, Any] = dict(
            socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
            **self._credentials,
        )
        try:
            if self._cluster:
                from redis.cluster import RedisCluster

                return RedisCluster.from_url(self._url, **options)
            return self._redis.Redis.from_url(self._url, **options)
        except Exception as err:
            raise self._error("connect", err) from None

    def _error(self, op: str, err: BaseException) -> StoreError:
        message = f"{type(err).__name__}: {err}"
        for secret in self._secrets:
            message = message.replace(secret, "***")
        timeout = isinstance(err, (self._redis.exceptions.TimeoutError, TimeoutError))
        return StoreError(f"redis {op} failed ({message})", timeout=timeout)

    # ------------------------------------------------------------ verbs
    def exists_many(self, names: Sequence[str]) -> list[bool]:
        if not names:
            return []
        client = self._client(lookup=True)
        try:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return [bool(n) for n in pipe.execute()]
        except Exception as err:
            raise self._error("exists", err) from None

    def fetch_many(self, names: Sequence[str]) -> list[bytes | None]:
        if not names:
            return []
        client = self._client(lookup=False)
        try:
            values = client.mget_nonatomic(list(names)) if self._cluster else client.mget(list(names))
            return list(values)
        except Exception as err:
            raise self._error("get", err) from None

    def fetch_many_into(
        self, names: Sequence[str], split_at: int, allocate: BodyAllocator
    ) -> list[ReceivedValue | None]:
        """MGETs whose replies are received straight into ``allocate``'s memory (single node).

        The names go in consecutive MGETs of about ``MGET_REPLY_BYTES`` of reply each
        (sized by the values the previous one returned), one round trip after another on
        one connection.

        redis-py sends the command on one of its pooled connections (auth, TLS, unix
        sockets as configured); ``BulkArrayReader`` reads the reply from that connection's
        socket instead of redis-py's parser, saving the parser's copies of every value.
        A fault drops the connection (its stream position is unknown); redis-py
        reconnects on the next use. A cluster client keeps redis-py's own path.
        """
        if not names:
            return []
        if self._cluster:
            return super().fetch_many_into(names, split_at, allocate)
        client = self._client(lookup=False)
        try:
            pool = client.connection_pool
            conn = pool.get_connection()
        except Exception as err:
            raise self._error("get", err) from None
        try:
            values: list[ReceivedValue | None] = []
            while len(values) < len(names):
                group = names[len(values) : len(values) + self._mget_size()]
                conn.send_command("MGET", *group)  # connects first when needed, so the socket exists below
                received = BulkArrayReader(conn._sock).read_values(split_at, allocate)
                if len(received) != len(group):
                    raise ReplyError(f"MGET of {len(group)} keys answered {len(received)} values")
                self._learn_value_bytes(received)
                values.extend(received)
            return values
        except BaseException as err:
            conn.disconnect()
            if isinstance(err, Exception):
                raise self._error("get", err) from None
            raise
        finally:
            pool.release(conn)

    def _mget_size(self) -> int:
        """Keys per MGET: replies of about MGET_REPLY_BYTES (one key until a value's size is known)."""
        return max(1, MGET_REPLY_BYTES // self._value_bytes) if self._value_bytes else 1

    def _learn_value_bytes(self, received: Sequence[ReceivedValue | None]) -> None:
        sizes = [len(v.head) + len(v.body) for v in received if v is not None]
        if sizes:
            self._value_bytes = max(sizes)  # a rank's chunks share one size; the latest batch tells it

    def upload_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        if not items:
            return
        client = self._client(lookup=False)
        try:
            pipe = client.pipeline(transaction=False)
            for name, value in items:
                pipe.set(name, value, ex=self._ttl_s)
            pipe.execute()
        except Exception as err:
            raise self._error("put", err) from None

    def pipeline(self, commands: Callable[[Any], object], *, lookup: bool) -> list[Any]:
        """The commands ``commands(pipe)`` queues on a redis-py pipeline, sent in one round trip; their replies.

        For small records other parts keep in the same store (the peer tier's holders), on the lookup client
        (its short timeout) or the I/O client."""
        client = self._client(lookup)
        try:
            pipe = client.pipeline(transaction=False)
            commands(pipe)
            return list(pipe.execute())
        except Exception as err:
            raise self._error("pipeline", err) from None

    def ping(self) -> None:
        try:
            self._client(lookup=True).ping()
        except StoreError:
            raise
        except Exception as err:
            raise self._error("ping", err) from None

    def warm_up(self) -> None:
        for lookup in (True, False):
            try:
                self._client(lookup).ping()
            except StoreError:
                raise
            except Exception as err:
                raise self._error("ping", err) from None

    def close(self) -> None:
        with self._lock:
            clients, self._lookup_client, self._io_client = (self._lookup_client, self._io_client), None, None
        for client in clients:
            if client is not None:
                try:
                    client.close()
                except Exception:  # closing a broken connection: nothing left to do
                    pass
