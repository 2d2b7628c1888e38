"""Stateful sessions at the front door: LMI's header spellings on top of AWS's session library.

Runs in vLLM's API server process. Session bookkeeping (NEW_SESSION, CLOSE,
validation of ids, expiry, the ``/dev/shm`` store) is
``model_hosting_container_standards.sagemaker.sessions``, which vLLM already
applies to ``/invocations``; ``lmi-cache serve`` configures it from LMI's
options (see ``lmi_cache.front.options``). What this module adds, per
djl-serving ``serving/docs/stateful_sessions.md``:

- a NEW_SESSION answer carries LMI's ``X-Amzn-SageMaker-Session-Id: <id>;
  Expires=<time>`` besides the library's ``X-Amzn-SageMaker-New-Session-Id``;
- a request may send the id in either header, with or without the
  ``; Expires=...`` suffix that clients copy from the answer;
- a request naming an expired session is refused (the library would close it
  and serve the request as if it had no session).
"""
from __future__ import annotations

import time

SESSION_HEADER = b"x-amzn-sagemaker-session-id"
NEW_SESSION_HEADER = b"x-amzn-sagemaker-new-session-id"
Headers = list[tuple[bytes, bytes]]


def _bare(value: bytes) -> bytes:
    return value.split(b";", 1)[0].strip()


def normalize_request_headers(headers: Headers) -> tuple[Headers, str | None]:
    """One ``x-amzn-sagemaker-session-id`` header holding the bare id (or none); returns it too."""
    session = next((v for k, v in headers if k == SESSION_HEADER), None)
    if session is None:
        session = next((v for k, v in headers if k == NEW_SESSION_HEADER), None)
    if session is None:
        return headers, None
    bare = _bare(session)
    kept = [(k, v) for k, v in headers if k not in (SESSION_HEADER, NEW_SESSION_HEADER)]
    kept.append((SESSION_HEADER, bare))
    return kept, bare.decode("latin-1")


def add_lmi_session_header(headers: Headers) -> Headers:
    """Copy the library's New-Session-Id answer into LMI's Session-Id header."""
    new = next((v for k, v in headers if k == NEW_SESSION_HEADER), None)
    if new is None or any(k == SESSION_HEADER for k, _ in headers):
        return headers
    return [*headers, (SESSION_HEADER, new)]


def expired_session_error(session_id: str) -> str | None:
    """An error line when ``session_id`` names a session past its expiry (closing it); else None.

    Unknown ids are left to the library, which answers 400 "session not found".
    """
    from model_hosting_container_standards.sagemaker.sessions.manager import get_session_manager

    manager = get_session_manager()
    if manager is None:
        return None
    session = manager.sessions.get(session_id)
    if session is None or session.expiration_ts is None or time.time() <= session.expiration_ts:
        return None
    try:
        manager.close_session(session_id)
    except ValueError:
        pass  # closed concurrently
    return f"Bad request: session expired: {session_id}; start a new one with {{\"requestType\": \"NEW_SESSION\"}}"
