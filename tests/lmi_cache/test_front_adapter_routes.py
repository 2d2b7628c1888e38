"""Runtime adapter routes: off by default, confined to the configured folders when on (stub app, no vLLM)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmi_cache.front.adapter_routes import RUNTIME_ENV, AdapterRoutes
from lmi_cache.front.adapters import Adapter
from lmi_cache.front.options import FrontOptionError, front_launch
from tests.lmi_cache.test_front_hostile import front, raw_call
from tests.lmi_cache.test_front_middleware import COMPLETION, StubApp, run

REPO = Path(__file__).resolve().parents[2]
ROUTES = [("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}),
          ("POST", "/v1/unload_lora_adapter", {"lora_name": "x"}),
          ("POST", "/adapters", {"name": "x", "src": "/etc"}),
          ("DELETE", "/adapters/x", None)]


def peft(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (folder / "adapter_model.bin").write_bytes(b"")
    return folder


def call(app: object, method: str, path: str, payload: object) -> tuple[int, dict[str, object]]:
    body = json.dumps(payload).encode() if payload is not None else b""
    status, _, answer, _ = raw_call(app, body, {"Content-Type": "application/json"}, path=path, method=method)
    try:
        return status, json.loads(answer)
    except ValueError:
        return status, {}


@pytest.mark.parametrize("method, path, payload", ROUTES)
def test_runtime_adapter_routes_are_404_by_default(method: str, path: str, payload: object) -> None:
    stub = StubApp(body="ok")
    status, reply = call(front(stub), method, path, payload)
    assert status == 404 and stub.calls == 0 and "option.enable_runtime_adapters" in str(reply["error"])


@pytest.fixture()
def roots(tmp_path: Path) -> Path:
    root = tmp_path / "adapters"
    peft(root / "good")
    (root / "not-peft").mkdir()
    outside = peft(tmp_path / "outside")
    os.symlink(outside, root / "link-out")
    return root


def routes(root: Path, **kwargs: object) -> AdapterRoutes:
    static = {"folder-one": Adapter("folder-one", root / "good", rank=4)}
    return AdapterRoutes(static, enabled=True, roots=[root], **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("src, status", [
    ("/etc", 403), ("../outside", 403), ("link-out", 403), ("/root", 403), ("not-peft", 400),
    ("s3://bucket/a", 400), ("", 400), ("good/../../outside", 403), ("a" * 300, 403), ("a" * 5000, 400)])
def test_a_source_outside_the_roots_or_not_an_adapter_is_refused(roots: Path, src: str, status: int) -> None:
    stub = StubApp(body="ok")
    app = front(stub, routes=routes(roots))
    for path, body in (("/adapters", {"name": "t", "src": src}), ("/v1/load_lora_adapter",
                                                                  {"lora_name": "t", "lora_path": src})):
        got, reply = call(app, "POST", path, body)
        assert got == status and stub.calls == 0
        assert str(roots.parent) not in json.dumps(reply)  # where adapters live stays in the log


def test_a_good_adapter_is_forwarded_with_its_real_path_and_then_servable(roots: Path) -> None:
    stub = StubApp(body="ok")
    table = routes(roots)
    app = front(stub, routes=table, base_names=frozenset({"base"}))
    assert run(app, {"prompt": "Q", "model": "t"})[0] == 404
    status, _ = call(app, "POST", "/adapters", {"name": "t", "src": str(roots / "good")})
    assert status == 200 and stub.seen_body == {"name": "t", "src": os.path.realpath(roots / "good")}
    assert run(app, {"prompt": "Q", "model": "t"})[0] == 200
    status, _ = call(app, "DELETE", "/adapters/t", None)
    assert status == 200 and "t" not in table.runtime
    assert run(app, {"prompt": "Q", "model": "t"})[0] == 404


def test_names_are_bounded_in_length_shape_and_count(roots: Path) -> None:
    stub = StubApp(body="ok")
    app = front(stub, routes=routes(roots, max_runtime=2))
    for bad in ("x" * 129, "../x", "a b", "", None):
        assert call(app, "POST", "/adapters", {"name": bad, "src": "good"})[0] == 400
    assert call(app, "POST", "/adapters", {"name": "folder-one", "src": "good"})[0] == 409
    assert [call(app, "POST", "/adapters", {"name": n, "src": "good"})[0] for n in ("a", "b", "c")] == [200, 200, 429]
    assert call(app, "POST", "/adapters", {"name": "a", "src": "good"})[0] == 200  # re-registering is not a new one
    assert call(app, "DELETE", "/adapters/zz", None)[0] == 404
    assert stub.calls == 3


def test_a_failed_load_in_vllm_does_not_register_the_name(roots: Path) -> None:
    stub = StubApp(status=400, body={"error": {"message": "bad weights"}})
    table = routes(roots)
    assert call(front(stub, routes=table), "POST", "/v1/load_lora_adapter",
                {"lora_name": "t", "lora_path": "good"})[0] == 400
    assert table.runtime == {}


def test_runtime_adapters_are_an_explicit_option_that_needs_lora(tmp_path: Path) -> None:
    assert RUNTIME_ENV not in front_launch({"enable_lora": "true"}, tmp_path, prepare=False).env
    with pytest.raises(FrontOptionError, match="needs option.enable_lora=true"):
        front_launch({"enable_runtime_adapters": "true"}, tmp_path, prepare=False)
    launch = front_launch({"enable_lora": "true", "enable_runtime_adapters": "true", "max_runtime_adapters": "3"},
                          tmp_path, prepare=False)
    assert launch.env[RUNTIME_ENV] == "true" and launch.env["LMI_CACHE_RUNTIME_ADAPTER_ROOTS"] == str(
        tmp_path / "adapters")
    assert launch.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "true"
    with pytest.raises(FrontOptionError, match="absolute folders"):
        front_launch({"enable_lora": "true", "enable_runtime_adapters": "true", "runtime_adapter_roots": "rel"},
                     tmp_path, prepare=False)


def test_the_front_package_imports_no_vllm() -> None:
    code = ("import sys, lmi_cache.front.middleware, lmi_cache.front.options;"
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.strip() == "[]"


def test_the_body_limit_follows_max_model_len(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    env = front_launch({}, None, model_path=tmp_path, prepare=False).env
    assert env["LMI_CACHE_MAX_REQUEST_BYTES"] == str(4096 * 24 + (1 << 20))
    env = front_launch({"max_model_len": "1000"}, None, model_path=tmp_path, prepare=False).env
    assert env["LMI_CACHE_MAX_REQUEST_BYTES"] == str(1000 * 24 + (1 << 20))
    assert front_launch({"max_request_bytes": "5000"}, None, prepare=False).env["LMI_CACHE_MAX_REQUEST_BYTES"] == "5000"
    with pytest.raises(FrontOptionError, match="max_request_bytes"):
        front_launch({"max_request_bytes": "lots"}, None, prepare=False)


def test_unload_of_a_folder_adapter_is_refused(roots: Path) -> None:
    stub = StubApp(body=COMPLETION)
    assert call(front(stub, routes=routes(roots)), "POST", "/v1/unload_lora_adapter",
                {"lora_name": "folder-one"})[0] == 404
