"""Stateful sessions at the front door: LMI's header spellings on top of AWS's session library.

Runs in vLLM's API server process. Session bookkeeping (NEW_SESSION, CLOSE,
validation of ids, expiry, the ``/dev/shm`` store) is
``model_hosting_container_standards.sagemaker.sessions``, which vLLM already
applies to ``/invocations``; ``lmi-cache serve`` configures it from LMI's
options (see ``lmi_cache.front.options``). What this module adds, per
djl-serving ``serving/docs/stateful_sessions.md``:

- a NEW_SESSION answer carries LMI's ``X-Amzn-SageMaker-Session-Id: <id>;
  Expires=<time>`` besides the library's ``X-Amzn-SageMaker-New-Session-Id``
  (NEW_SESSION and CLOSE themselves: ``lmi_cache.front.session_store``);
- a request may send the id in either header, with or without the
  ``; Expires=...`` suffix that clients copy from the answer;
- a request naming an expired session is refused (the library would close it
  and serve the request as if it had no session);
- SageMaker's own create request (``InvokeEndpoint(SessionId="NEW_SESSION")``
  with the ``{"requestType": "NEW_SESSION"}`` payload) arrives with the header
  ``X-Amzn-SageMaker-Session-Id: NEW_SESSION``: the header is ignored on a
  create request, as the library does; on any other request ``NEW_SESSION``
  means "no session" (the library's reading) and the request is served without one;
- an id that is empty or not an id's shape is refused with 400 before anything reads it.
"""
from __future__ import annotations

import re
import time

from lmi_cache.front.guard import ClientError

SESSION_HEADER = b"x-amzn-sagemaker-session-id"
NEW_SESSION_HEADER = b"x-amzn-sagemaker-new-session-id"
VLLM_SESSION_HEADER = b"x-session-id"  # vLLM's SESSION_ID_HEADER (vllm/entrypoints/generate/base/serving.py)
Headers = list[tuple[bytes, bytes]]
# The library's ids are UUIDs; this also keeps "..", "/" and control bytes out of file names and logs.
_SESSION_ID = re.compile(rb"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")


def _bare(value: bytes) -> bytes:
    return value.split(b";", 1)[0].strip()


NEW_SESSION = b"NEW_SESSION"  # SageMaker's SessionId for "open one"; on other requests: no session


def normalize_request_headers(headers: Headers, creating: bool = False) -> tuple[Headers, str | None]:
    """One ``x-amzn-sagemaker-session-id`` header holding the bare, checked id (or none); returns it too.

    A client's own ``X-Session-ID`` is dropped: vLLM gets the validated id or none.
    ``creating``: the body is ``{"requestType": "NEW_SESSION"}``, whose session header (SageMaker
    sends ``NEW_SESSION``) names no session to check. A header ``NEW_SESSION`` is "no session".
    Raises ClientError 400 for an id that is empty or not an id.
    """
    session = next((v for k, v in headers if k == SESSION_HEADER), None)
    if session is None:
        session = next((v for k, v in headers if k == NEW_SESSION_HEADER), None)
    kept = [(k, v) for k, v in headers if k not in (SESSION_HEADER, NEW_SESSION_HEADER, VLLM_SESSION_HEADER)]
    if session is None or creating:
        return kept, None
    bare = _bare(session)
    if bare == NEW_SESSION:
        return kept, None
    if not bare:
        raise ClientError(400, "empty session id; send the id from NEW_SESSION's answer or no session header")
    if not _SESSION_ID.fullmatch(bare):
        raise ClientError(400, "malformed session id; send the id from NEW_SESSION's answer")
    kept.append((SESSION_HEADER, bare))
    kept.append((VLLM_SESSION_HEADER, bare))
    return kept, bare.decode("ascii")


def expired_session_error(session_id: str) -> str | None:
    """An error line when ``session_id`` names a session past its expiry (closing it); else None.

    Unknown ids are left to the library, which answers 400 "session not found".
    """
    from model_hosting_container_standards.sagemaker.sessions.manager import get_session_manager

    from lmi_cache.front.session_store import was_swept

    if was_swept(session_id):  # expired, and the background sweep closed it already (ids are never reused)
        return _expired(session_id)
    manager = get_session_manager()
    if manager is None:
        return None
    session = manager.sessions.get(session_id)
    if session is None or session.expiration_ts is None or time.time() <= session.expiration_ts:
        return None
    try:
        manager.close_session(session_id)
    except (ValueError, OSError):
        pass  # closed concurrently, or its folder is gone: the sweep forgets it
    return _expired(session_id)


def _expired(session_id: str) -> str:
    return f"Bad request: session expired: {session_id}; start a new one with {{\"requestType\": \"NEW_SESSION\"}}"
