"""``remote_url``, parsed once: the one check every reader shares (torch-free; any process).

A URL reaches lmi-cache from an LMCache YAML, ``LMCACHE_REMOTE_URL`` or LMI's
``option.lmcache_remote_url``, and is then read by the plan, the start-up
probe, the stores and every message. Each of them asks :func:`parse_remote_url`,
so a URL accepted by one is accepted by all: auto-configuration can never write
a ``remote_url`` that the engine refuses when vLLM starts.

Schemes are LMCache's (``lmi_cache.config.keys.REMOTE_URL_SCHEMES``); a
scheme lmi-cache has no store for parses (the remote tier is then off, with a
warning), while :meth:`RemoteUrl.store_kind` is the check for a store that must
be served. Messages never show credentials: they quote :attr:`RemoteUrl.redacted`.
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from lmi_cache.config.keys import REMOTE_URL_SCHEMES, SERVED_REMOTE_SCHEMES
from lmi_cache.errors import ConfigError

# Redis-protocol schemes -> what redis-py calls them (Valkey speaks the same protocol).
REDIS_SCHEMES = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss", "unix": "unix"}
_TRUE = {"1", "true", "yes", "on"}


def redact_url(url: str) -> str:
    """``url`` without its userinfo (credentials never reach logs or messages)."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc.rpartition("@")[2]
        if "@" in parts.netloc:
            netloc = "***@" + netloc
        return f"{parts.scheme}://{netloc}{parts.path}"
    except ValueError:
        return "<unparseable url>"


@dataclass(frozen=True)
class RemoteUrl:
    """A checked ``remote_url``: its scheme and, for the stores lmi-cache serves, where the store is."""

    text: str  # as given (may hold credentials: never log it)
    scheme: str  # lower case, e.g. "rediss"

    @property
    def redacted(self) -> str:
        return redact_url(self.text)

    @property
    def served(self) -> bool:
        """Whether lmi-cache has a store for this scheme (the others leave the remote tier off)."""
        return self.scheme in SERVED_REMOTE_SCHEMES

    def store_kind(self) -> str:
        """"redis" or "s3"; ConfigError naming the (redacted) URL for a scheme lmi-cache does not serve."""
        if self.scheme in REDIS_SCHEMES:
            return "redis"
        if self.scheme == "s3":
            return "s3"
        raise ConfigError(f"remote_url {self.redacted!r}: unsupported scheme {self.scheme!r}; use redis://, "
                          "rediss://, valkey://, valkeys://, unix:// or s3://")

    def flag(self, name: str) -> bool:
        """A true/false query option of the URL, e.g. ``?cluster=true``."""
        return dict(parse_qsl(urlsplit(self.text).query)).get(name, "").lower() in _TRUE

    @property
    def password(self) -> str | None:
        password = urlsplit(self.text).password
        return unquote(password) if password else None

    def redis_client_url(self) -> str:
        """The URL redis-py understands: valkey schemes mapped, lmi-cache's own query options removed."""
        parts = urlsplit(self.text)
        query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k != "cluster"])
        return f"{REDIS_SCHEMES[self.scheme]}://{parts.netloc}{parts.path}" + (f"?{query}" if query else "")

    def s3_location(self) -> tuple[str, str]:
        """``s3://bucket/some/prefix`` -> ("bucket", "some/prefix") (prefix without slashes at the ends)."""
        parts = urlsplit(self.text)
        return parts.netloc, parts.path.strip("/")


def parse_remote_url(text: str, name: str = "remote_url") -> RemoteUrl:
    """Check ``text`` as a ``remote_url``; ConfigError (one line, credentials redacted) when it cannot be used.

    Any scheme LMCache knows parses; a served one must also say where its store is:
    Redis/Valkey a host (the port defaults to 6379, as in redis-py) and a valid
    port if one is given, ``unix://`` a socket path, ``s3://`` a bucket. ``name``
    is the setting messages call it (the peer tier's holder store is checked here too).
    """
    scheme = text.partition("://")[0].lower() if "://" in text else ""
    if scheme == "file":
        return RemoteUrl(text, scheme)
    if scheme not in REMOTE_URL_SCHEMES:
        shown = f"scheme {scheme[:20]!r}" if scheme else "a value without a scheme://"
        raise ConfigError(f"{name} has {shown}, an unsupported scheme LMCache does not know either; use "
                          f"{', '.join(s + '://' for s in sorted(SERVED_REMOTE_SCHEMES))} (or another of "
                          "LMCache's remote backends)")
    url = RemoteUrl(text, scheme)
    if scheme not in SERVED_REMOTE_SCHEMES:
        return url
    try:
        parts = urlsplit(text)
        host, _ = parts.hostname, parts.port  # .port raises ValueError on a bad one
    except ValueError:
        raise ConfigError(f"{name} {url.redacted!r} has a bad port; use a number 1-65535") from None
    if scheme == "unix":
        if not parts.path:
            raise ConfigError(f"{name} {url.redacted!r} has no socket path; e.g. unix:///run/redis.sock")
    elif scheme == "s3":
        if not parts.netloc or "@" in parts.netloc:
            raise ConfigError(f"{name} {url.redacted!r} needs a bucket, e.g. s3://my-bucket/kv-cache")
    elif not host:
        raise ConfigError(f"{name} {url.redacted!r} has no host; e.g. {scheme}://cache:6379")
    return url
