"""What the connector's scheduler side reads of vLLM's request and scheduler output (vLLM scheduler process).

Typed views (``typing.Protocol``) of exactly the attributes the scheduler side
reads, so the bookkeeping is type-checked against vLLM's own classes
(``vllm.v1.request.Request``, ``vllm.v1.core.sched.output.SchedulerOutput``)
without importing vLLM, and tests drive it with small fakes of the same shape.
Attributes some vLLM objects lack (a request's ``session_id``, the output's
``preempted_req_ids``, ``kv_connector_block_state``) are read with ``getattr``
and stay out of these views.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class RequestView(Protocol):
    """A request being looked up or admitted."""

    @property
    def request_id(self) -> str: ...
    @property
    def num_tokens(self) -> int: ...  # prompt and output tokens so far


class NewRequestView(Protocol):
    """A request scheduled for the first time this step (vLLM's ``NewRequestData``)."""

    @property
    def req_id(self) -> str: ...
    @property
    def block_ids(self) -> Sequence[Sequence[int]]: ...  # one list per KV cache group
    @property
    def num_computed_tokens(self) -> int: ...


class CachedRequestsView(Protocol):
    """Requests scheduled again this step (vLLM's ``CachedRequestData``), one entry per request in each list."""

    @property
    def req_ids(self) -> Sequence[str]: ...
    @property
    def resumed_req_ids(self) -> set[str]: ...
    @property
    def new_block_ids(self) -> Sequence[Sequence[Sequence[int]] | None]: ...
    @property
    def num_computed_tokens(self) -> Sequence[int]: ...


class SchedulerOutputView(Protocol):
    """One step's scheduling decision."""

    @property
    def scheduled_new_reqs(self) -> Sequence[NewRequestView]: ...
    @property
    def scheduled_cached_reqs(self) -> CachedRequestsView: ...
    @property
    def num_scheduled_tokens(self) -> dict[str, int]: ...
    @property
    def finished_req_ids(self) -> set[str]: ...
