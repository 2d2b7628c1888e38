"""Per-adapter formatters (adapters/<name>/model.py): found without running, imported, applied, failures contained."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmi_cache.front.adapters import ADAPTERS_DIR_ENV, Adapter
from lmi_cache.front.formatters import (
    FORMATTERS_ENV,
    FormatterError,
    Formatters,
    apply_input,
    apply_output,
    load_formatters,
    scan_formatter_file,
)
from lmi_cache.front.middleware import LmiFrontMiddleware, build_registry
from tests.lmi_cache.test_front_middleware import COMPLETION, FakeSessions, StubApp, run

# As LMI's docs write them (input_formatter_schema.md / output_formatter_schema.md, vLLM signatures).
LMI_STYLE = '''
from djl_python.input_parser import input_formatter
from djl_python.output_formatter import output_formatter

@input_formatter
def custom_input(decoded_payload: dict, tokenizer=None, **kwargs) -> dict:
    if decoded_payload.get("explode"):
        raise RuntimeError("bad payload")
    if "inputPrompt" in decoded_payload:
        decoded_payload["inputs"] = decoded_payload.pop("inputPrompt")
    decoded_payload.setdefault("parameters", {}).setdefault("max_new_tokens", 5)
    return decoded_payload

@output_formatter
def custom_output(response_data: dict) -> dict:
    choice = response_data["choices"][0]
    if choice.get("text") == "BOOM":
        raise ValueError("cannot format BOOM")
    return {"custom": True, "text": choice.get("text")}
'''


def _formatters(tmp_path: Path, code: str = LMI_STYLE, name: str = "fmt") -> Formatters:
    folder = tmp_path / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(code)
    found = load_formatters(name, folder)
    assert found is not None
    return found


def test_the_scan_finds_decorated_formatters_without_running_the_file(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / "model.py"
    path.write_text(LMI_STYLE + f"\nopen({str(marker)!r}, 'w').write('x')\n")
    assert scan_formatter_file(path) == ["input", "output"]
    assert not marker.exists()
    path.write_text("def plain(x):\n    return x\n")
    assert scan_formatter_file(path) == []
    path.write_text("@input_formatter\ndef f(x):\n    return x +\n")
    with pytest.raises(ValueError, match=r"model.py line 3: invalid syntax"):
        scan_formatter_file(path)


def test_an_lmi_model_py_loads_without_lmi_installed(tmp_path: Path) -> None:
    found = _formatters(tmp_path)
    assert found.kinds() == ["input", "output"]
    assert apply_input(found, {"inputPrompt": "Q"}) == {"inputs": "Q", "parameters": {"max_new_tokens": 5}}
    assert json.loads(apply_output(found, COMPLETION)) == {"custom": True, "text": " hi"}
    assert load_formatters("none", tmp_path / "empty") is None


@pytest.mark.parametrize("code, words", [
    ("import no_such_package_here\n", ["failed to import", "ModuleNotFoundError", "no_such_package_here"]),
    ("raise SystemExit(3)\n", ["failed to import", "SystemExit"]),
    ("from djl_python.encode_decode import decode\n", ["failed to import", "djl_python.encode_decode"]),
])
def test_a_model_py_that_fails_to_import_is_one_line(tmp_path: Path, code: str, words: list[str]) -> None:
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / "model.py").write_text(code)
    with pytest.raises(ValueError) as info:
        load_formatters("a", folder)
    assert "\n" not in str(info.value)
    for word in words:
        assert word in str(info.value)


def test_formatter_failures_name_the_adapter_and_what_failed(tmp_path: Path) -> None:
    found = _formatters(tmp_path)
    with pytest.raises(FormatterError, match="adapter 'fmt' input formatter failed: RuntimeError: bad payload"):
        apply_input(found, {"explode": True})
    with pytest.raises(FormatterError, match="output formatter failed: ValueError: cannot format BOOM"):
        apply_output(found, {"choices": [{"text": "BOOM"}]})
    odd = _formatters(tmp_path, "from lmi_cache.front.formatters import input_formatter, output_formatter\n"
                                "@input_formatter\ndef f(p, tokenizer=None):\n    return ['not', 'a', 'dict']\n"
                                "@output_formatter\ndef g(r):\n    return {1, 2}\n", name="odd")
    with pytest.raises(FormatterError, match="returned list, expected a dict"):
        apply_input(odd, {"inputs": "Q"})
    with pytest.raises(FormatterError, match="output formatter failed: TypeError"):
        apply_output(odd, COMPLETION)


def test_the_front_applies_an_adapters_formatters_to_its_requests_only(tmp_path: Path) -> None:
    fmt = _formatters(tmp_path)
    stub = StubApp(body=COMPLETION)
    front = LmiFrontMiddleware(stub, adapters={}, formatters={"fmt": fmt})
    status, headers, body = run(front, {"inputPrompt": "Q"}, {"X-Amzn-SageMaker-Adapter-Identifier": "fmt"})
    assert stub.seen_body == {"prompt": "Q", "max_tokens": 5}
    assert status == 200 and json.loads(body) == {"custom": True, "text": " hi"}
    assert headers[b"content-type"] == b"application/json"
    for payload in ({"inputs": "Q", "adapters": "fmt"}, {"prompt": "Q", "model": "fmt"}):
        _, _, body = run(front, payload)
        assert json.loads(body) == {"custom": True, "text": " hi"}
    _, _, body = run(front, {"inputs": "Q"})  # the base model: LMI's shape
    assert json.loads(body) == {"generated_text": " hi"}


def test_a_formatter_that_raises_is_a_424_and_the_front_keeps_serving(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    stub = StubApp(body=COMPLETION)
    front = LmiFrontMiddleware(stub, adapters={}, formatters={"fmt": _formatters(tmp_path)})
    status, _, body = run(front, {"inputs": "Q", "explode": True, "adapters": "fmt"})
    assert status == 424 and stub.calls == 0
    answer = json.loads(body)
    # The client learns which formatter failed and the request id; the exception text stays in the log.
    assert answer == {"error": "adapter 'fmt' input formatter failed", "code": 424,
                      "request_id": answer["request_id"]}
    assert f"{answer['request_id']} /invocations -> 424" in caplog.text and "RuntimeError: bad payload" in caplog.text
    boom = StubApp(body={"choices": [{"index": 0, "text": "BOOM"}]})
    status, _, body = run(LmiFrontMiddleware(boom, adapters={}, formatters={"fmt": _formatters(tmp_path)}),
                          {"inputs": "Q", "adapters": "fmt"})
    assert status == 424 and json.loads(body)["error"] == "adapter 'fmt' output formatter failed"
    assert "cannot format BOOM" not in body.decode() and "ValueError: cannot format BOOM" in caplog.text
    status, _, _ = run(front, {"inputs": "Q", "adapters": "fmt"})
    assert status == 200


def test_streamed_chunks_go_through_the_formatter_one_line_each(tmp_path: Path) -> None:
    events = [{"choices": [{"index": 0, "text": t}]} for t in (" a", " b", "BOOM", " c")]
    raw = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    stub = StubApp(sse=[raw[:9], raw[9:40], raw[40:]])
    front = LmiFrontMiddleware(stub, adapters={}, formatters={"fmt": _formatters(tmp_path)})
    status, headers, body = run(front, {"inputs": "Q", "stream": True, "adapters": "fmt"})
    assert status == 200 and headers[b"content-type"] == b"application/jsonlines"
    lines = [json.loads(line) for line in body.decode().splitlines()]
    assert lines[:2] == [{"custom": True, "text": " a"}, {"custom": True, "text": " b"}]
    # The formatter raised on the third chunk: LMI's error line with the reason, and the stream ends.
    assert lines[2]["details"]["finish_reason"] == "error"
    assert lines[2]["error"] == "adapter 'fmt' output formatter failed" and lines[2]["request_id"]
    assert len(lines) == 3


def test_vllm_errors_keep_their_status_through_a_formatted_adapter(tmp_path: Path) -> None:
    stub = StubApp(status=400, body={"error": {"message": "prompt too long", "code": 400}})
    front = LmiFrontMiddleware(stub, adapters={}, formatters={"fmt": _formatters(tmp_path)})
    status, _, body = run(front, {"inputs": "Q", "adapters": "fmt"})
    assert status == 400 and json.loads(body) == {"error": "prompt too long", "code": 400}
    status, _, body = run(front, {"prompt": "Q", "model": "fmt"})
    assert status == 400 and json.loads(body) == {"error": {"message": "prompt too long", "code": 400}}


def test_an_adapter_whose_model_py_fails_to_import_is_refused_with_424(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    from lmi_cache.devtools.tiny_lora import make_broken_lora

    adapters = tmp_path / "adapters"
    for name, code in (("good", LMI_STYLE), ("bad", "import no_such_package_here\n")):
        (adapters / name).mkdir(parents=True)
        (adapters / name / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
        (adapters / name / "adapter_model.bin").write_bytes(b"")
        (adapters / name / "model.py").write_text(code)
    make_broken_lora(adapters / "broken")
    env = {ADAPTERS_DIR_ENV: str(adapters), FORMATTERS_ENV: "true"}
    registry, formatters = build_registry(env)
    assert registry["good"].ok and sorted(formatters) == ["good"]
    assert registry["bad"].error is not None and "no_such_package_here" in registry["bad"].error
    assert not registry["broken"].ok
    stub = StubApp(body=COMPLETION)
    status, _, body = run(LmiFrontMiddleware(stub, adapters=registry, formatters=formatters),
                          {"inputs": "Q", "adapters": "bad"})
    assert status == 424 and stub.calls == 0
    error = json.loads(body)["error"]
    assert error == "adapter 'bad' failed registration; the server log says why"
    assert "model.py failed to import: ModuleNotFoundError" in caplog.text
    # Without the option nothing is imported: no formatters, nobody refused for its model.py.
    registry, formatters = build_registry({ADAPTERS_DIR_ENV: str(adapters)})
    assert formatters == {} and registry["bad"].ok


def test_a_broken_adapter_entry_is_not_loaded(tmp_path: Path) -> None:
    from lmi_cache.front.formatters import load_all

    folder = tmp_path / "x"
    folder.mkdir()
    (folder / "model.py").write_text("raise RuntimeError('must not run')\n")
    loaded, failed = load_all({"x": Adapter("x", folder, error="no adapter_config.json")}, enabled=True)
    assert loaded == {} and failed == {}


def test_a_vllm_error_mid_stream_is_lmis_error_line_not_formatted(tmp_path: Path) -> None:
    good = {"choices": [{"index": 0, "text": " a"}]}
    failed = {"error": {"message": "engine dead", "code": 500}}
    raw = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in (good, failed, good))
    stub = StubApp(sse=[raw])
    front = LmiFrontMiddleware(stub, adapters={}, formatters={"fmt": _formatters(tmp_path)})
    _, _, body = run(front, {"inputs": "Q", "stream": True, "adapters": "fmt"})
    lines = [json.loads(line) for line in body.decode().splitlines()]
    assert lines[0] == {"custom": True, "text": " a"}
    assert lines[1]["details"]["finish_reason"] == "error" and lines[1]["error"] == "engine dead"
    assert len(lines) == 2


def test_session_requests_naming_a_formatted_adapter_skip_the_formatters(tmp_path: Path) -> None:
    stub = StubApp(body=COMPLETION)
    sessions = FakeSessions()
    front = LmiFrontMiddleware(stub, adapters={}, formatters={"fmt": _formatters(tmp_path)}, sessions=sessions)
    status, headers, body = run(front, {"requestType": "NEW_SESSION"}, {"X-Amzn-SageMaker-Adapter-Identifier": "fmt"})
    assert status == 200 and body == b"Session s1 created" and stub.calls == 0
    assert headers[b"x-amzn-sagemaker-session-id"] == b"s1; Expires=2030-01-01T00:00:00Z"
