"""Stateful sessions kept bounded and robust: start-up folder check, capped creation, background expiry.

Two processes use it. ``lmi-cache serve`` (container start, before vLLM and
so before AWS's session library reads the folder) calls
``prepare_sessions_folder``: a session left half-written by a crash (its
``.expiration_ts`` missing, empty or not a number) or past its expiry is
removed, and anything that is not a session folder is moved aside, each kind
reported in one line, instead of the library failing at import or on every
NEW_SESSION. In vLLM's API server process the front middleware answers
NEW_SESSION and CLOSE itself through ``SessionGate``: creation is refused
with 429 past a cap on open sessions, writes the expiry atomically, and does
not sweep all sessions under the library's lock; a daemon thread sweeps
expired sessions instead, and remembers the ids it closed (bounded), so a
request naming one is told its session expired rather than "not found",
whenever the sweep ran. Sessions live in the library's ``SessionManager``
(``model_hosting_container_standards.sagemaker.sessions.manager``), whose
registry vLLM's ``/invocations`` validates ids against.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from lmi_cache.front.guard import ClientError

logger = logging.getLogger("lmi_cache.front")
EXPIRY_FILE = ".expiration_ts"  # the library's name for a session's expiry file
DEFAULT_MAX_SESSIONS = 10_000


# Ids the sweep closed as expired, newest last, at most this many (a set of short strings).
_SWEPT: "OrderedDict[str, None]" = OrderedDict()
_SWEPT_LOCK = threading.Lock()


def _remember_swept(session_id: str) -> None:
    with _SWEPT_LOCK:
        _SWEPT[session_id] = None
        while len(_SWEPT) > DEFAULT_MAX_SESSIONS:
            _SWEPT.popitem(last=False)


def was_swept(session_id: str) -> bool:
    """Whether the background sweep closed ``session_id`` because it expired."""
    with _SWEPT_LOCK:
        return session_id in _SWEPT


class SessionsFolderError(ValueError):
    """The sessions folder cannot be used at all (it is a file, or cannot be read)."""


def _expiry(folder: Path) -> float | None:
    try:
        value = json.loads((folder / EXPIRY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def prepare_sessions_folder(path: Path, now: float | None = None) -> list[str]:
    """Make ``path`` safe for the session library to load; one line per kind of change made.

    Raises SessionsFolderError (one line) when ``path`` exists but is not a usable folder.
    """
    now = time.time() if now is None else now
    if not path.exists() and not path.is_symlink():
        return []
    if not path.is_dir():
        raise SessionsFolderError(f"sessions folder {path} is not a directory; remove it or set "
                                  "option.sessions_path to a directory")
    try:
        entries = sorted(path.iterdir())
    except OSError as err:
        raise SessionsFolderError(f"sessions folder {path} cannot be read ({err.strerror}); "
                                  "fix its permissions or set option.sessions_path") from None
    crashed = expired = 0
    strays: list[Path] = []
    for entry in entries:
        if entry.is_symlink() or not entry.is_dir():
            strays.append(entry)
            continue
        expiry = _expiry(entry)
        if expiry is not None and expiry > now:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        if expiry is None:
            crashed += 1
        else:
            expired += 1
    lines = []
    if crashed or expired:
        lines.append(f"sessions folder {path}: removed {crashed} unreadable (crashed) and {expired} expired "
                     f"session{'s' if crashed + expired != 1 else ''}")
    if strays:
        lines.append(_quarantine(path, strays))
    return lines


def _quarantine(path: Path, strays: list[Path]) -> str:
    """Move entries that are not session folders next to the folder (the library lists every entry)."""
    aside = path.with_name(path.name + ".quarantine")
    try:
        aside.mkdir(mode=0o700, exist_ok=True)
        for entry in strays:
            os.replace(entry, aside / f"{entry.name}.{uuid.uuid4().hex[:8]}")
    except OSError as err:
        raise SessionsFolderError(f"sessions folder {path}: {len(strays)} entries are not sessions and cannot "
                                  f"be moved to {aside} ({err.strerror}); remove them") from None
    many = len(strays) != 1
    return f"sessions folder {path}: moved {len(strays)} stray entr{'ies' if many else 'y'} " \
           f"(not session folders) to {aside}"


def _manager() -> Any:
    from model_hosting_container_standards.sagemaker.sessions.manager import get_session_manager

    return get_session_manager()


class SessionGate:
    """NEW_SESSION and CLOSE for the front, on the library's manager; expiry swept in the background."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS, manager: Any = None,
                 sweep_every_s: float | None = None) -> None:
        self.max_sessions = max_sessions
        self._manager = manager
        self._sweeper: threading.Thread | None = None
        self._sweep_every_s = sweep_every_s

    @property
    def manager(self) -> Any:
        if self._manager is None:
            self._manager = _manager()
        return self._manager

    def _require(self) -> Any:
        manager = self.manager
        if manager is None:
            raise ClientError(400, "stateful sessions are off on this server (option.enable_stateful_sessions)")
        self._start_sweeper(manager)
        return manager

    def create(self) -> tuple[str, str]:
        """A new session: (id, LMI's header value ``<id>; Expires=<UTC time>``); ClientError 429 past the cap."""
        from model_hosting_container_standards.sagemaker.sessions.manager import Session

        manager = self._require()
        with manager._lock:
            if len(manager.sessions) >= self.max_sessions:
                soonest = min((s.expiration_ts or 0.0 for s in manager.sessions.values()), default=0.0)
                wait = max(1, min(int(soonest - time.time()) + 1, int(manager.expiration)))
                raise ClientError(429, f"{self.max_sessions} sessions are open, the most this server keeps; "
                                       "close one or retry later", headers=[(b"retry-after", str(wait).encode())])
            session_id = str(uuid.uuid4())
            expires = time.time() + manager.expiration
            folder = Path(manager.sessions_path) / session_id
            folder.mkdir(mode=0o700)
            # Written whole or not at all: a crash mid-write must not leave an empty expiry file.
            partial = folder / f"{EXPIRY_FILE}.tmp"
            partial.write_text(json.dumps(expires), encoding="utf-8")
            os.replace(partial, folder / EXPIRY_FILE)
            manager.sessions[session_id] = Session(session_id, manager.sessions_path, expires)
        stamp = datetime.fromtimestamp(expires, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return session_id, f"{session_id}; Expires={stamp}"

    def close(self, session_id: str) -> None:
        """Close ``session_id``; ClientError 400 when it is not open."""
        manager = self._require()
        try:
            manager.close_session(session_id)
        except ValueError:
            raise ClientError(400, f"Bad request: session not found: {session_id}") from None

    def _start_sweeper(self, manager: Any) -> None:
        if self._sweeper is not None:
            return
        every = self._sweep_every_s or min(60.0, max(1.0, manager.expiration / 10))
        self._sweeper = threading.Thread(target=self._sweep_forever, args=(manager, every),
                                         name="lmi-cache-session-sweep", daemon=True)
        self._sweeper.start()

    def _sweep_forever(self, manager: Any, every: float) -> None:
        while True:
            time.sleep(every)
            sweep_expired(manager)


def sweep_expired(manager: Any, now: float | None = None) -> int:
    """Close every session past its expiry (or without one); returns how many were removed."""
    now = time.time() if now is None else now
    with manager._lock:
        due = [sid for sid, s in manager.sessions.items() if s.expiration_ts is None or now > s.expiration_ts]
    removed = 0
    for session_id in due:
        try:
            manager.close_session(session_id)
            _remember_swept(session_id)
        except ValueError:
            continue  # closed meanwhile
        except OSError as err:  # not a folder, or gone: forget it rather than fail every sweep
            logger.warning("lmi-cache front: dropped session %s whose folder cannot be removed (%s)",
                           session_id, err.strerror)
            with manager._lock:
                manager.sessions.pop(session_id, None)
        removed += 1
    return removed
