"""Per-adapter input/output formatters: an adapter folder's ``model.py``, LMI's way, opt-in.

Runs in two processes. ``lmi-cache serve`` (container start) only *reads*
each ``adapters/<name>/model.py`` (``scan_formatter_file``: a syntax check and
the names of its decorated functions, no code runs) to print what it found.
vLLM's API server process, where the front middleware lives, imports the
files (``load_formatters``) and applies them per request.

As documented in djl-serving ``serving/docs/lmi/user_guides/input_formatter_schema.md``
and ``output_formatter_schema.md`` ("Adapter Level: Place model.py in an
adapter directory"; vLLM backend signatures), and as LMI's
``djl_python/custom_formatter_handling.py`` applies them:

- ``@input_formatter def f(decoded_payload: dict, tokenizer=None, **kwargs) -> dict``
  gets the request body as a dict before the front reads it, and returns the
  body to serve (LMI ``inputs`` or OpenAI ``prompt`` / ``messages``);
- ``@output_formatter def g(response_data: dict)`` gets vLLM's answer as a
  dict (the OpenAI completion or chat response; each streamed chunk when
  streaming) and its return value is sent instead of LMI's shape.

The decorators only mark the function (``is_input_formatter`` /
``is_output_formatter``, LMI's attributes). A model.py written for LMI imports
them from ``djl_python.input_parser`` / ``djl_python.output_formatter``; when
djl_python is not installed those two modules are provided here.

Loading user code is a trust decision: LMI runs every adapter's model.py; here
only with ``option.enable_adapter_formatters=true``. A model.py that fails to
import refuses its adapter (requests naming it get 424, like a broken adapter);
a formatter that raises on a request gets a 424 (LMI's status for a failed
custom formatter) or, mid-stream, LMI's error line, saying which formatter
failed (the exception itself goes to the log); the server keeps running.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

FORMATTERS_FILE = "model.py"
ENABLE_OPTION = "enable_adapter_formatters"
FORMATTERS_ENV = "LMI_CACHE_ADAPTER_FORMATTERS"  # "true" when serve turned them on
FORMATTER_STATUS = 424  # LMI: "Custom formatter failed"
_DECORATORS = {"input_formatter": "input", "output_formatter": "output"}


def input_formatter(function: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``function`` as the adapter's input formatter (LMI's ``@input_formatter``)."""
    function.is_input_formatter = True  # type: ignore[attr-defined]
    return function


def output_formatter(function: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``function`` as the adapter's output formatter (LMI's ``@output_formatter``)."""
    function.is_output_formatter = True  # type: ignore[attr-defined]
    return function


class FormatterError(Exception):
    """A formatter failed on a request: ``reason`` is what the client gets, ``str()`` the log's details."""

    status = FORMATTER_STATUS

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or message


@dataclass(frozen=True)
class Formatters:
    adapter: str
    input: Callable[..., Any] | None = None
    output: Callable[[Any], Any] | None = None

    def kinds(self) -> list[str]:
        return [k for k, f in (("input", self.input), ("output", self.output)) if f is not None]


def scan_formatter_file(path: Path) -> list[str]:
    """The formatter kinds ``path`` declares (``input``, ``output``), read without running it.

    Raises ValueError with one line when the file cannot be read or parsed.
    """
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as err:
        raise ValueError(f"{path.name} line {err.lineno}: {err.msg}") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"{path.name}: {err}") from None
    kinds = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for deco in node.decorator_list:
                name = deco.attr if isinstance(deco, ast.Attribute) else getattr(deco, "id", "")
                if name in _DECORATORS:
                    kinds.add(_DECORATORS[name])
    return sorted(kinds)


def _provide_djl_python() -> None:
    """Make ``from djl_python.input_parser import input_formatter`` work without LMI installed."""
    if "djl_python" in sys.modules or importlib.util.find_spec("djl_python") is not None:
        return
    package = types.ModuleType("djl_python")
    package.__path__ = []  # a package, so that its submodules import
    for sub, name, function in (("input_parser", "input_formatter", input_formatter),
                                ("output_formatter", "output_formatter", output_formatter)):
        module = types.ModuleType(f"djl_python.{sub}")
        setattr(module, name, function)
        setattr(package, sub, module)
        sys.modules[module.__name__] = module
    sys.modules["djl_python"] = package


def load_formatters(adapter: str, folder: Path) -> Formatters | None:
    """Import ``folder/model.py`` and find its formatters; None without the file.

    Raises ValueError with one line (the exception type and message) when the
    file fails to import or declares a formatter that is not callable.
    """
    path = folder / FORMATTERS_FILE
    if not path.is_file():
        return None
    _provide_djl_python()
    module_name = "lmi_cache_adapter_formatters_" + re.sub(r"\W", "_", adapter)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{FORMATTERS_FILE}: cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException as err:  # noqa: BLE001 - user code: SystemExit included, one line, never a crash
        sys.modules.pop(module_name, None)
        if isinstance(err, KeyboardInterrupt):
            raise
        raise ValueError(f"{FORMATTERS_FILE} failed to import: {_describe(err)}") from None
    found: dict[str, Callable[..., Any]] = {}
    for value in vars(module).values():
        for kind in ("input", "output"):
            if getattr(value, f"is_{kind}_formatter", False) is True and callable(value):
                found.setdefault(kind, value)
    return Formatters(adapter, found.get("input"), found.get("output"))


def _describe(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def apply_input(formatters: Formatters, payload: Any, tokenizer: Any = None) -> Any:
    """The request body after the adapter's input formatter; FormatterError when it fails."""
    if formatters.input is None:
        return payload
    try:
        result = formatters.input(payload, tokenizer=tokenizer)
    except Exception as err:  # noqa: BLE001 - user code
        raise FormatterError(f"adapter {formatters.adapter!r} input formatter failed: {_describe(err)}",
                             f"adapter {formatters.adapter!r} input formatter failed") from None
    if not isinstance(result, dict):
        raise FormatterError(f"adapter {formatters.adapter!r} input formatter returned "
                             f"{type(result).__name__}, expected a dict (the request body)",
                             f"adapter {formatters.adapter!r} input formatter failed")
    return result


def apply_output(formatters: Formatters, response: Any) -> bytes:
    """The bytes to send for one vLLM answer (or streamed chunk); FormatterError when it fails.

    A str is sent as it is; anything else as JSON (a streamed chunk ends with a newline: jsonlines).
    """
    assert formatters.output is not None
    try:
        result = formatters.output(response)
        if hasattr(result, "model_dump"):  # a pydantic object, as LMI accepts
            result = result.model_dump()
        if isinstance(result, bytes):
            return result
        if isinstance(result, str):
            return result.encode("utf-8")
        return json.dumps(result, ensure_ascii=False).encode("utf-8")
    except Exception as err:  # noqa: BLE001 - user code, or a value json cannot encode
        raise FormatterError(f"adapter {formatters.adapter!r} output formatter failed: {_describe(err)}",
                             f"adapter {formatters.adapter!r} output formatter failed") from None


def load_all(adapters: dict[str, Any], enabled: bool) -> tuple[dict[str, Formatters], dict[str, str]]:
    """Formatters of every registered adapter when ``enabled``; and {name: why} for those that failed."""
    loaded: dict[str, Formatters] = {}
    failed: dict[str, str] = {}
    if not enabled:
        return loaded, failed
    for name, adapter in adapters.items():
        if not adapter.ok:
            continue
        try:
            found = load_formatters(name, adapter.path)
        except ValueError as err:
            failed[name] = str(err)
            print(f"lmi-cache front: adapter {name} refused: {err}", file=sys.stderr, flush=True)
            continue
        if found is not None and found.kinds():
            loaded[name] = found
    return loaded, failed
