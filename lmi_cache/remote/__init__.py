"""Remote (fleet-wide) KV tier: values, stores and the non-blocking client (vLLM worker process).

- ``value_codec``: chunk object <-> remote value (optional keyed MAC, optional
  lossless compression); every fault decodes to a typed miss reason.
- ``settings``: ``RemoteSettings`` parsed from ``remote_url`` plus typed options.
- ``store``: the byte-level ``RemoteStore`` interface and its errors: value
  bytes by name (``exists_many``, ``fetch_many``, ``fetch_many_into``,
  ``upload_many``).
- ``redis_store`` / ``s3_store``: Redis/Valkey (single node or cluster) and S3.
- ``cache``: ``RemoteCache``, verified chunks by ``ChunkKey`` over a store
  (``has_many``, ``has_many_async``, ``read_many``, ``read_many_into``,
  ``write``): batched lookups under a timeout, reconnect with backoff,
  counters; ``put_queue``: its bounded asynchronous write queue and writer
  thread.
- ``tier``: ``RemoteTier``, the engine's ``Tier`` protocol (``get_many``,
  ``put``, ``contains``) over a ``RemoteCache``.
- ``factory``: ``open_remote`` (settings -> RemoteCache; imports redis/boto3 only
  when used) and ``probe_remote`` (one PING/HEAD for start-up messages).
"""
from __future__ import annotations

from lmi_cache.remote.factory import open_remote, open_store, probe_remote
from lmi_cache.remote.settings import RemoteSettings

__all__ = ["RemoteSettings", "open_remote", "open_store", "probe_remote"]
