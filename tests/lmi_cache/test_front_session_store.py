"""Sessions bounded and robust, on AWS's real session manager in a temporary folder (no vLLM)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from model_hosting_container_standards.sagemaker.sessions.manager import SessionManager

from lmi_cache.front.guard import ClientError
from lmi_cache.front.middleware import LmiFrontMiddleware
from lmi_cache.front.options import FrontOptionError, front_launch
from lmi_cache.front.session_store import SessionGate, prepare_sessions_folder, sweep_expired
from tests.lmi_cache.test_front_middleware import COMPLETION, StubApp, run


def manager(path: Path, expiration_s: int = 60) -> SessionManager:
    return SessionManager({"sessions_path": str(path), "sessions_expiration": str(expiration_s)})


def crashed_folder(path: Path) -> Path:
    """What a crash leaves: an empty expiry file, a stray file, an expired and a live session."""
    (path / "crashed").mkdir(parents=True)
    (path / "crashed" / ".expiration_ts").write_text("")
    (path / "stray.txt").write_text("left here by hand")
    (path / "old").mkdir()
    (path / "old" / ".expiration_ts").write_text(json.dumps(time.time() - 10))
    (path / "live").mkdir()
    (path / "live" / ".expiration_ts").write_text(json.dumps(time.time() + 600))
    return path


def test_a_crashed_sessions_folder_is_cleaned_so_the_library_starts_and_creates(tmp_path: Path) -> None:
    folder = crashed_folder(tmp_path / "sessions")
    with pytest.raises(ValueError):  # what the library does with it as it is: it cannot even start
        manager(folder)
    lines = prepare_sessions_folder(folder)
    assert lines == [f"sessions folder {folder}: removed 1 unreadable (crashed) and 1 expired sessions",
                     f"sessions folder {folder}: moved 1 stray entry (not session folders) to {folder}.quarantine"]
    assert sorted(p.name for p in folder.iterdir()) == ["live"]
    assert [p.read_text() for p in (tmp_path / "sessions.quarantine").iterdir()] == ["left here by hand"]
    store = manager(folder)
    assert list(store.sessions) == ["live"]
    new_id, _ = SessionGate(manager=store).create()
    assert set(store.sessions) == {"live", new_id}


def test_serve_checks_the_sessions_folder_at_start(tmp_path: Path) -> None:
    folder = crashed_folder(tmp_path / "sessions")
    launch = front_launch({"sessions_path": str(folder)}, None)
    assert any("removed 1 unreadable (crashed) and 1 expired" in line for line in launch.summary)
    # A second start finds nothing to clean.
    assert not any("sessions folder" in line for line in front_launch({"sessions_path": str(folder)}, None).summary)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FrontOptionError, match="option.sessions_path: sessions folder .* is not a directory"):
        front_launch({"sessions_path": str(tmp_path / "file")}, None)


def test_new_sessions_are_capped_with_429_and_retry_after(tmp_path: Path) -> None:
    gate = SessionGate(max_sessions=3, manager=manager(tmp_path / "s", expiration_s=120))
    ids = [gate.create()[0] for _ in range(3)]
    with pytest.raises(ClientError) as info:
        gate.create()
    assert info.value.status == 429
    retry = dict(info.value.headers)[b"retry-after"]
    assert 1 <= int(retry) <= 121
    gate.close(ids[0])
    assert gate.create()[0] not in ids
    status, headers, _ = run(LmiFrontMiddleware(StubApp(body=COMPLETION), adapters={}, sessions=gate),
                             {"requestType": "NEW_SESSION"})
    assert status == 429 and headers[b"retry-after"]


def test_creating_a_session_writes_its_expiry_whole_and_sweeps_nothing(tmp_path: Path) -> None:
    store = manager(tmp_path / "s", expiration_s=60)
    gate = SessionGate(manager=store)
    old, _ = gate.create()
    store.sessions[old].expiration_ts = time.time() - 1  # expired: left to the background sweep
    new, header = gate.create()
    assert old in store.sessions
    assert json.loads((tmp_path / "s" / new / ".expiration_ts").read_text()) == store.sessions[new].expiration_ts
    assert header.startswith(f"{new}; Expires=") and header.endswith("Z")
    assert not list((tmp_path / "s" / new).glob("*.tmp"))
    assert sweep_expired(store) == 1 and set(store.sessions) == {new}


def test_the_background_sweep_closes_expired_sessions(tmp_path: Path) -> None:
    store = manager(tmp_path / "s", expiration_s=1)
    gate = SessionGate(manager=store, sweep_every_s=0.05)
    session_id, _ = gate.create()
    deadline = time.monotonic() + 5
    while session_id in store.sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert session_id not in store.sessions and not (tmp_path / "s" / session_id).exists()


def test_a_stray_entry_in_the_registry_does_not_break_the_sweep(tmp_path: Path) -> None:
    store = manager(tmp_path / "s")
    (tmp_path / "s" / "stray").write_text("x")
    from model_hosting_container_standards.sagemaker.sessions.manager import Session

    store.sessions["stray"] = Session("stray", str(tmp_path / "s"), expiration_ts=None)
    assert sweep_expired(store) == 1 and "stray" not in store.sessions
    SessionGate(manager=store).create()


def test_close_of_an_unknown_session_is_a_400(tmp_path: Path) -> None:
    gate = SessionGate(manager=manager(tmp_path / "s"))
    with pytest.raises(ClientError) as info:
        gate.close("nope")
    assert info.value.status == 400 and "session not found" in info.value.reason


def test_a_session_the_sweep_closed_is_still_answered_as_expired(tmp_path: Path) -> None:
    """Whenever the sweep ran, a request naming an expired session is told so, not "session not found"."""
    from lmi_cache.front.sessions import expired_session_error

    store = manager(tmp_path / "s", expiration_s=60)
    gate = SessionGate(manager=store)
    old, _ = gate.create()
    live, _ = gate.create()
    store.sessions[old].expiration_ts = time.time() - 1
    assert sweep_expired(store) == 1 and old not in store.sessions
    assert (expired_session_error(old) or "").startswith(f"Bad request: session expired: {old};")
    assert expired_session_error(live) is None
    gate.close(live)  # closed by the client: not expired
    assert expired_session_error(live) is None
