"""Which stateful sessions are open, as the scheduler sees them (torch-free, vLLM scheduler process).

The front door (API-server process) opens and closes sessions through AWS's
session library, which keeps each open session as a directory
``<sessions_path>/<id>`` holding its ``.expiration_ts``: CLOSE removes the
directory, and the expiry is absolute (creation + ``sessions_expiration``).
The scheduler runs in vLLM's engine-core process and inherits the same
``SAGEMAKER_*`` environment, so it reads that store instead of needing a
message from the front: a session is open while its directory exists and its
expiry has not passed. Requests reach the scheduler with vLLM's
``request.session_id`` (the front forwards the id as ``X-Session-ID``).

Without the session store (plain vLLM with our connector, or sessions turned
off) a ``session_id`` still names a conversation; its retention then ends
after ``sessions_expiration`` seconds without a request of that session.

The tracker turns this into per-step work for the workers: which new chunk
digests each session retains, and which sessions to release. Liveness checks
are bounded per step (a few ``stat`` calls) so thousands of open sessions
never slow scheduling; the number of tracked sessions is bounded too.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

ENABLED_ENV = "SAGEMAKER_ENABLE_STATEFUL_SESSIONS"
PATH_ENV = "SAGEMAKER_SESSIONS_PATH"
EXPIRATION_ENV = "SAGEMAKER_SESSIONS_EXPIRATION"
DEFAULT_EXPIRATION_S = 1200.0  # the session library's and LMI's default
MAX_SESSION_ID_CHARS = 256

# Per-chunk digests of one prompt chunk, one per rank (rank = pp_rank * tp_size + tp_rank).
RankDigests = tuple[bytes, ...]


@dataclass(frozen=True)
class SessionSource:
    """Where open sessions are known from: the session library's store, or requests alone."""

    store_path: str | None
    expiration_s: float = DEFAULT_EXPIRATION_S

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SessionSource:
        """The settings ``lmi-cache serve`` exported for the front door (defaults as the library's)."""
        try:
            expiration_s = float(env.get(EXPIRATION_ENV, "") or DEFAULT_EXPIRATION_S)
        except ValueError:
            expiration_s = DEFAULT_EXPIRATION_S
        if expiration_s <= 0:
            expiration_s = DEFAULT_EXPIRATION_S
        if env.get(ENABLED_ENV, "").strip().lower() not in ("true", "1", "yes"):
            return cls(None, expiration_s)
        path = env.get(PATH_ENV) or _library_default_path()
        return cls(path, expiration_s)


def _library_default_path() -> str:
    # Mirrors the session library's choice when no path is configured.
    if os.path.exists("/dev/shm") and os.access("/dev/shm", os.R_OK | os.W_OK):
        return "/dev/shm/sagemaker_sessions"
    return os.path.join(tempfile.gettempdir(), "sagemaker_sessions")


@dataclass
class _Session:
    expires_at: float  # wall clock; idle mode: last request + expiration_s
    digests: set[RankDigests] = field(default_factory=set)


@dataclass(frozen=True)
class RetentionStep:
    """What the workers apply this step: release first, then retain."""

    retain: dict[str, list[RankDigests]]
    release: list[str]


class SessionTracker:
    """Open sessions and the chunks they retain; see the module docstring."""

    def __init__(
        self,
        source: SessionSource,
        *,
        max_sessions: int = 10_000,
        checks_per_step: int = 16,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.source = source
        self._max_sessions = max_sessions
        self._checks_per_step = checks_per_step
        self._clock = clock
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # next liveness check first
        self._pending_retain: dict[str, list[RankDigests]] = {}
        self._pending_release: list[str] = []
        self.num_released = 0

    @property
    def num_open(self) -> int:
        return len(self._sessions)

    def note(self, session_id: str | None, chunks: Sequence[RankDigests]) -> bool:
        """A request of ``session_id`` was scheduled with these prompt chunks; True if they are retained."""
        if not session_id or len(session_id) > MAX_SESSION_ID_CHARS:
            return False
        now = self._clock()
        session = self._sessions.get(session_id)
        if session is None:
            expires_at = self._open_expiry(session_id, now)
            if expires_at is None:
                return False  # not a session the front door opened (or already closed)
            session = _Session(expires_at)
            self._sessions[session_id] = session
            self._bound_sessions()
        elif self.source.store_path is None:
            session.expires_at = now + self.source.expiration_s
        fresh = [chunk for chunk in chunks if chunk not in session.digests]
        if fresh:
            session.digests.update(fresh)
            self._pending_retain.setdefault(session_id, []).extend(fresh)
        return True

    def take_step(self) -> RetentionStep:
        """This step's retains (new digests only) and releases (closed, expired or idle sessions)."""
        self._check_some(self._clock())
        step = RetentionStep(self._pending_retain, self._pending_release)
        self._pending_retain, self._pending_release = {}, []
        return step

    # ------------------------------------------------------------ liveness
    def _open_expiry(self, session_id: str, now: float) -> float | None:
        """When an open session expires; None if it is not open."""
        path = self.source.store_path
        if path is None:
            return now + self.source.expiration_s
        if "/" in session_id or session_id.startswith("."):
            return None  # not an id the library makes; never a path outside the store
        folder = os.path.join(path, session_id)
        if not os.path.isdir(folder):
            return None
        expires_at = _read_expiry(folder)
        if expires_at is None:
            expires_at = now + self.source.expiration_s
        return expires_at if now <= expires_at else None

    def _is_open(self, session_id: str, session: _Session, now: float) -> bool:
        if now > session.expires_at:
            return False
        path = self.source.store_path
        return path is None or os.path.isdir(os.path.join(path, session_id))

    def _check_some(self, now: float) -> None:
        for _ in range(min(self._checks_per_step, len(self._sessions))):
            session_id, session = self._sessions.popitem(last=False)
            if self._is_open(session_id, session, now):
                self._sessions[session_id] = session  # back of the queue
            else:
                self._release(session_id)

    def _bound_sessions(self) -> None:
        while len(self._sessions) > self._max_sessions:
            oldest = next(iter(self._sessions))
            self._sessions.pop(oldest)
            logger.warning("lmi-cache: more than %d sessions retain chunks; released %s early",
                           self._max_sessions, oldest)
            self._release(oldest)

    def _release(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        self._pending_retain.pop(session_id, None)
        self._pending_release.append(session_id)
        self.num_released += 1


def _read_expiry(folder: str) -> float | None:
    try:
        with open(os.path.join(folder, ".expiration_ts"), encoding="utf-8") as handle:
            value = json.load(handle)
        return float(value)
    except (OSError, ValueError, TypeError):
        return None
