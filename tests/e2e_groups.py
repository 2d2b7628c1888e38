"""The two groups of e2e modules, each run by one pytest-xdist worker (test process).

Under ``-n 3`` two workers start on the two groups while the third runs the fast
tier (``tests/conftest.py``: ``pytest_xdist_make_scheduler``). A group's shared vLLM
jobs are started by its worker only (``tests/e2e/conftest.py``).
"""
from __future__ import annotations

from pathlib import Path

E2E_DIR = Path(__file__).parent / "e2e"
E2E_PREFIX = f"{E2E_DIR.relative_to(E2E_DIR.parents[1]).as_posix()}/"  # how node ids (rootdir-relative) begin

# The e2e modules of the second e2e group (every other e2e module is in the first). Under pytest-xdist each
# group runs in one worker, so the two groups' vLLM starts use both cores while a third worker runs the fast
# tier. Readers of one shared job (``tests/e2e/shared_jobs.py``) stay in one group, or each group's worker
# starts that job too. The split balances the groups' measured times (``--durations``, one vLLM start each
# at a time): move a module when one group ends minutes before the other.
E2E_SECOND_GROUP = frozenset({
    "test_sliding_window_e2e.py", "test_sliding_window_session_e2e.py", "test_sliding_window_features_e2e.py",
    "test_kv_events_e2e.py", "test_multimodal_e2e.py", "test_hybrid_ssm_e2e.py",
    "test_front_e2e.py", "test_metrics_dp_e2e.py", "test_serve_lmi_e2e.py", "test_session_retention_e2e.py",
})


_UNKNOWN = E2E_SECOND_GROUP - {path.name for path in E2E_DIR.glob("test_*.py")}
if _UNKNOWN:  # a renamed or removed module: say so rather than move its tests to the first group unseen
    raise RuntimeError(f"tests/e2e_groups.py: E2E_SECOND_GROUP names no module in tests/e2e: {sorted(_UNKNOWN)}")


def e2e_scope(nodeid: str) -> str | None:
    """The xdist scope of an e2e test ("e2e-1" or "e2e-2"), None for any other test."""
    if not nodeid.startswith(E2E_PREFIX):
        return None
    module = nodeid[len(E2E_PREFIX):].split("::", 1)[0]
    return "e2e-2" if module in E2E_SECOND_GROUP else "e2e-1"
