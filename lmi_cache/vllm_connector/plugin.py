"""vLLM general plugin: remembers the model vLLM loads, so the blending connector can run its layers.

Runs in every vLLM process that loads plugins (API server, engine core,
workers); only a worker loads a model. vLLM calls ``register`` through the
entry point group ``vllm.general_plugins`` (name ``lmi_cache_blend``), before
the model is built. It wraps ``BaseModelLoader.load_model`` (the one call every
model loader goes through) to keep a weak reference to the result: no fork of
vLLM, no change to the model, and nothing kept alive after vLLM drops it.
Calling ``register`` twice wraps once.

It also routes the ``lmi_cache`` loggers through vLLM's log handlers: they have
none of their own, so without this Python's last-resort handler printed their
warnings bare and their info lines never reached the server's log.
"""
from __future__ import annotations

import logging
import os
import weakref
from typing import Any

logger = logging.getLogger(__name__)

_model_ref: "weakref.ReferenceType[Any] | None" = None
_WRAPPED_FLAG = "_lmi_cache_blend_wrapped"


def loaded_model() -> Any | None:
    """The last model vLLM loaded in this process, or None."""
    return _model_ref() if _model_ref is not None else None


def remember_model(model: Any) -> None:
    global _model_ref
    try:
        _model_ref = weakref.ref(model)
    except TypeError:  # not weak-referenceable (never for nn.Module): keep nothing rather than leak
        _model_ref = None


class HostHandler(logging.Handler):
    """Hands each record to the host logger's handlers as they are when it is emitted.

    vLLM configures its logging lazily (per engine, from its LoggingConfig) and
    may replace its handlers later, so they are looked up per record, not
    copied once. Before vLLM has a handler (or with its logging turned off)
    a record goes where Python would have put it (the root logger's handlers, else stderr).
    """

    def __init__(self, host: logging.Logger, ours: logging.Logger) -> None:
        super().__init__()
        self.host = host
        self.ours = ours

    def emit(self, record: logging.LogRecord) -> None:
        # A handler that also hangs on one of our ancestors (pytest puts its capture handlers on the root
        # logger and on vLLM's) gets the record by propagation already: handing it over again doubles it.
        reached = _propagation_handlers(self.ours)
        handlers = [handler for handler in self.host.handlers if handler not in reached]
        if not handlers:  # the record still propagates to the root logger; with no handler there either, stderr
            if not reached and logging.lastResort is not None and record.levelno >= logging.lastResort.level:
                logging.lastResort.handle(record)
            return
        for handler in handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def _propagation_handlers(logger: logging.Logger) -> set[logging.Handler]:
    """The handlers a record logged on ``logger`` reaches through its ancestors."""
    found: set[logging.Handler] = set()
    current: logging.Logger | None = logger
    while current is not None and current.propagate:
        current = current.parent
        if current is not None:
            found.update(current.handlers)
    return found


def route_logs_through(ours: logging.Logger, host: logging.Logger, level: str) -> None:
    """``ours`` prints through ``host``'s handlers (vLLM's format and stream) from ``level`` up, unless set up already."""
    if ours.handlers:  # configured by the user (or routed already)
        return
    ours.addHandler(HostHandler(host, ours))
    ours.setLevel(logging.getLevelName(level.upper()) if level.upper() in logging.getLevelNamesMapping() else logging.INFO)
    # Records still propagate: the root logger has no handler in vLLM's processes, and a host application's
    # (or pytest's log capture) keeps seeing them.


def register() -> None:
    """The plugin entry point (``vllm.general_plugins``)."""
    route_logs_through(logging.getLogger("lmi_cache"), logging.getLogger("vllm"),
                       os.environ.get("VLLM_LOGGING_LEVEL", "INFO"))
    try:
        from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    except ImportError as err:  # a vLLM without this loader: blending will find the model another way
        logger.warning("lmi-cache: blend plugin not installed (%s)", err)
        return
    original = BaseModelLoader.load_model
    if getattr(original, _WRAPPED_FLAG, False):
        return

    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        model = original(self, *args, **kwargs)
        remember_model(model)
        return model

    setattr(load_model, _WRAPPED_FLAG, True)
    load_model.__doc__ = original.__doc__
    BaseModelLoader.load_model = load_model  # type: ignore[method-assign]
