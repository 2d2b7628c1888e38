"""The benchmark's vLLM server launcher: command, environment, start-up failure."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmi_cache.bench.vllm_server import OUR_CONNECTOR, ServerSpec, ServerStartError, VllmServer


def test_command_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", "/elsewhere.yaml")
    spec = ServerSpec(model_dir=tmp_path / "m", kv_transfer_config=OUR_CONNECTOR, max_model_len=4096)
    server = VllmServer(spec, tmp_path / "run")
    command = server.command()
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "--enforce-eager" in command and command[command.index("--dtype") + 1] == "float32"
    assert "--no-enable-prefix-caching" in command
    assert json.loads(command[command.index("--kv-transfer-config") + 1]) == OUR_CONNECTOR
    assert command[command.index("--port") + 1] == str(server.port)
    env = server.environment()
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CACHE_ROOT"].startswith(str(tmp_path / "run"))
    # vLLM's IPC sockets: a folder of the server's own with a short path, whatever the run folder's length.
    rpc = Path(env["VLLM_RPC_BASE_PATH"])
    assert rpc.is_dir() and not rpc.is_relative_to(tmp_path) and len(str(rpc)) < 40
    server.stop()
    assert not rpc.exists()
    # A stray config from the caller's shell must not leak into a no-connector run.
    assert "LMCACHE_CONFIG_FILE" not in env
    with_prefix = VllmServer(ServerSpec(model_dir=tmp_path, prefix_caching=True), tmp_path / "r2").command()
    assert "--enable-prefix-caching" in with_prefix and "--kv-transfer-config" not in with_prefix


def test_server_that_exits_is_reported_with_its_log(tmp_path: Path) -> None:
    spec = ServerSpec(model_dir=tmp_path, python="/bin/false", ready_timeout_s=20)
    server = VllmServer(spec, tmp_path / "run")
    with pytest.raises(ServerStartError, match="exited with 1.*server.log"):
        server.start()


def test_first_error_is_the_root_cause(tmp_path: Path) -> None:
    from lmi_cache.bench.vllm_server import first_error

    log = tmp_path / "server.log"
    log.write_text(
        "INFO starting\n(Worker) ERROR [x.py:1] NameError: name 'Foo' is not defined\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    assert first_error(log) == "NameError: name 'Foo' is not defined"
    log.write_text("INFO all good\n")
    assert first_error(log) == ""


def test_first_error_skips_warnings_that_name_an_error(tmp_path: Path) -> None:
    from lmi_cache.bench.vllm_server import first_error

    log = tmp_path / "server.log"
    log.write_text(
        "(APIServer pid=1) WARNING 12-01 06:48:37 [system_utils.py:255] Found ulimit of 20000 ... "
        "fd limit errors like `OSError: [Errno 24] Too many open files`.\n"
        'zmq.error.ZMQError: ipc path "/tmp/x" is longer than 107 characters\n'
    )
    assert first_error(log) == 'ZMQError: ipc path "/tmp/x" is longer than 107 characters'
