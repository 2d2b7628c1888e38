"""The lmi_cache loggers print through vLLM's handlers once the plugin registers (fast tier: loggers made here)."""
from __future__ import annotations

import io
import logging

from lmi_cache.vllm_connector.plugin import route_logs_through


def _add_handler(host: logging.Logger, stream: io.StringIO) -> None:
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("HOST %(name)s %(levelname)s %(message)s"))
    host.addHandler(handler)


def test_info_lines_reach_handlers_the_host_gets_later_in_its_format() -> None:
    host, ours = logging.getLogger("fake-vllm-a"), logging.getLogger("lmi_cache_test_routing_a")
    route_logs_through(ours, host, "INFO")
    stream = io.StringIO()
    _add_handler(host, stream)  # vLLM configures its logging after plugins load
    logging.getLogger("lmi_cache_test_routing_a.tiers").info("adapter keyed")
    ours.debug("below the level")
    assert stream.getvalue() == "HOST lmi_cache_test_routing_a.tiers INFO adapter keyed\n"
    assert ours.propagate is True  # pytest's capture and a host application's root handlers still see them


def test_the_level_follows_vllms_setting() -> None:
    host, ours = logging.getLogger("fake-vllm-b"), logging.getLogger("lmi_cache_test_routing_b")
    stream = io.StringIO()
    _add_handler(host, stream)
    route_logs_through(ours, host, "debug")
    ours.debug("detail")
    assert stream.getvalue() == "HOST lmi_cache_test_routing_b DEBUG detail\n"


def test_a_logger_with_its_own_handler_is_left_alone() -> None:
    host, ours = logging.getLogger("fake-vllm-c"), logging.getLogger("lmi_cache_test_routing_c")
    _add_handler(host, io.StringIO())
    own = logging.StreamHandler(io.StringIO())
    ours.addHandler(own)
    route_logs_through(ours, host, "DEBUG")
    assert ours.handlers == [own] and ours.level == logging.NOTSET and ours.propagate is True


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_handler_the_host_shares_with_the_root_logger_gets_each_record_once() -> None:
    # pytest hangs its capture handlers on the root logger and on vLLM's; propagation delivers them already.
    host, ours = logging.getLogger("fake-vllm-d"), logging.getLogger("lmi_cache_test_routing_d")
    shared, host_only = _Count(), _Count()
    host.addHandler(shared)
    host.addHandler(host_only)
    logging.getLogger().addHandler(shared)
    try:
        route_logs_through(ours, host, "INFO")
        ours.warning("once")
    finally:
        logging.getLogger().removeHandler(shared)
    assert shared.messages == ["once"] and host_only.messages == ["once"]
