"""Tests for lmi_cache.eviction.session_tracker: which sessions are open, seen from the scheduler."""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from lmi_cache.eviction import session_tracker
from lmi_cache.eviction.session_tracker import DEFAULT_EXPIRATION_S, SessionSource, SessionTracker

CHUNK_A = (b"a" * 16, b"A" * 16)  # one chunk, two ranks
CHUNK_B = (b"b" * 16, b"B" * 16)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def open_session(store: Path, session_id: str, expires_at: float) -> None:
    """What the session library does on NEW_SESSION."""
    (store / session_id).mkdir(parents=True)
    (store / session_id / ".expiration_ts").write_text(json.dumps(expires_at))


def test_source_from_env() -> None:
    assert SessionSource.from_env({}) == SessionSource(None, DEFAULT_EXPIRATION_S)
    env = {"SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "true", "SAGEMAKER_SESSIONS_PATH": "/x/s",
           "SAGEMAKER_SESSIONS_EXPIRATION": "60"}
    assert SessionSource.from_env(env) == SessionSource("/x/s", 60.0)
    assert SessionSource.from_env({**env, "SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "false"}) == SessionSource(None, 60.0)
    assert SessionSource.from_env({**env, "SAGEMAKER_SESSIONS_EXPIRATION": "soon"}).expiration_s == DEFAULT_EXPIRATION_S
    enabled_default_path = SessionSource.from_env({"SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "true"})
    assert enabled_default_path.store_path is not None and enabled_default_path.store_path.endswith("sagemaker_sessions")


def test_store_mode_retains_new_digests_once_and_releases_on_close(tmp_path: Path) -> None:
    clock = Clock()
    open_session(tmp_path, "s1", clock.now + 600)
    tracker = SessionTracker(SessionSource(str(tmp_path), 600), clock=clock)
    assert tracker.note("s1", [CHUNK_A])
    assert tracker.note("s1", [CHUNK_A, CHUNK_B])  # next round re-sends the conversation
    step = tracker.take_step()
    assert step.retain == {"s1": [CHUNK_A, CHUNK_B]} and step.release == []
    assert tracker.take_step().retain == {}  # nothing new
    shutil.rmtree(tmp_path / "s1")  # CLOSE in the front door's process
    assert tracker.take_step().release == ["s1"]
    assert tracker.num_open == 0 and tracker.num_released == 1
    assert tracker.take_step().release == []


def test_store_mode_ignores_sessions_the_front_never_opened(tmp_path: Path) -> None:
    tracker = SessionTracker(SessionSource(str(tmp_path), 600))
    assert not tracker.note("made-up", [CHUNK_A])
    assert not tracker.note("../etc", [CHUNK_A]) and not tracker.note("", [CHUNK_A]) and not tracker.note(None, [])
    assert not tracker.note("x" * 300, [CHUNK_A])
    assert tracker.take_step().retain == {} and tracker.num_open == 0


def test_store_mode_releases_at_the_absolute_expiry(tmp_path: Path) -> None:
    clock = Clock()
    open_session(tmp_path, "s1", clock.now + 10)
    tracker = SessionTracker(SessionSource(str(tmp_path), 600), clock=clock)
    tracker.note("s1", [CHUNK_A])
    clock.now += 5
    tracker.note("s1", [CHUNK_B])  # requests do not extend a library session
    assert tracker.take_step().release == []
    clock.now += 6
    step = tracker.take_step()
    assert step.release == ["s1"]
    open_session(tmp_path, "old", clock.now - 1)  # expired, directory not yet cleaned up
    assert not tracker.note("old", [CHUNK_A])


def test_release_drops_a_retain_not_yet_sent(tmp_path: Path) -> None:
    clock = Clock()
    open_session(tmp_path, "s1", clock.now + 600)
    tracker = SessionTracker(SessionSource(str(tmp_path), 600), clock=clock)
    tracker.note("s1", [CHUNK_A])
    shutil.rmtree(tmp_path / "s1")
    step = tracker.take_step()
    assert step.retain == {} and step.release == ["s1"]  # never both for one session in one step


def test_idle_mode_releases_after_expiration_without_requests() -> None:
    clock = Clock()
    tracker = SessionTracker(SessionSource(None, 30), clock=clock)
    assert tracker.note("conv-1", [CHUNK_A])
    clock.now += 20
    tracker.note("conv-1", [CHUNK_A])  # a request keeps it alive
    clock.now += 20
    assert tracker.take_step().release == []
    clock.now += 11
    assert tracker.take_step().release == ["conv-1"]
    assert tracker.note("conv-1", [CHUNK_A])  # back again: retained afresh
    assert tracker.take_step().retain == {"conv-1": [CHUNK_A]}


def test_checks_per_step_are_bounded_but_every_session_is_checked_in_turn(tmp_path: Path) -> None:
    clock = Clock()
    names = [f"s{i}" for i in range(10)]
    for name in names:
        open_session(tmp_path, name, clock.now + 600)
    tracker = SessionTracker(SessionSource(str(tmp_path), 600), checks_per_step=3, clock=clock)
    for name in names:
        tracker.note(name, [CHUNK_A])
    for name in names:
        shutil.rmtree(tmp_path / name)
    released: list[str] = []
    for _ in range(3):
        step = tracker.take_step()
        assert len(step.release) <= 3
        released += step.release
    released += tracker.take_step().release
    assert sorted(released) == sorted(names)


def test_the_number_of_tracked_sessions_is_bounded(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # A library imported earlier in the session may configure logging with disable_existing_loggers.
    monkeypatch.setattr(session_tracker.logger, "disabled", False)
    caplog.set_level(logging.WARNING, logger=session_tracker.logger.name)
    tracker = SessionTracker(SessionSource(None, 600), max_sessions=2)
    for name in ("a", "b", "c"):
        tracker.note(name, [CHUNK_A])
    step = tracker.take_step()
    assert step.release == ["a"] and set(step.retain) == {"b", "c"} and tracker.num_open == 2
    assert "released a early" in caplog.text


def test_unreadable_expiry_falls_back_to_the_configured_lifetime(tmp_path: Path) -> None:
    clock = Clock()
    os.makedirs(tmp_path / "s1")
    tracker = SessionTracker(SessionSource(str(tmp_path), 50), clock=clock)
    assert tracker.note("s1", [CHUNK_A])
    clock.now += 51
    assert tracker.take_step().release == ["s1"]
