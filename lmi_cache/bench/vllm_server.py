"""Starts and stops a vLLM OpenAI server subprocess for benchmarks (bench process).

Used by ``benchmarks/bench_connector.py``; does not import vLLM (the server may
live in another venv, e.g. LMCache's). Every run gets its own folder for
``VLLM_CACHE_ROOT`` and the server log, a short folder of its own under the
system's temp directory for ``VLLM_RPC_BASE_PATH`` (vLLM's IPC sockets: a
socket path longer than 107 bytes fails the start), and the env
that makes CPU runs comparable (``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` always:
otherwise a kv_transfer_config silently changes the thread count).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from lmi_cache.errors import UserError

OUR_CONNECTOR = {
    "kv_connector": "LmiCacheConnector",
    "kv_connector_module_path": "lmi_cache.vllm_connector",
    "kv_role": "kv_both",
}
LMCACHE_CONNECTOR = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}


class ServerStartError(UserError):
    """The vLLM server exited or did not become ready; the message names its log."""


@dataclass
class ServerSpec:
    model_dir: Path
    served_model_name: str = "tiny"
    python: str = sys.executable
    max_model_len: int = 9216
    prefix_caching: bool = False
    kv_transfer_config: dict[str, str] | None = None
    lmcache_config_file: Path | None = None
    kvcache_space_gib: int = 2
    extra_env: dict[str, str] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    ready_timeout_s: float = 300.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def first_error(path: Path) -> str:
    """The first exception line of a server log (the root cause, before the re-raises)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in lines:
        if re.search(r"\] (INFO|WARNING|DEBUG) ", line) or re.search(r"\b(INFO|WARNING|DEBUG) \d\d-\d\d ", line):
            continue  # a log line that merely mentions an error (vLLM's ulimit warning names OSError)
        match = re.search(r"\b(\w+(Error|Exception)): .*", line)
        if match:
            return match.group(0).strip()
    return ""


def log_tail(path: Path, num_lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return ""


class VllmServer:
    """``with VllmServer(spec, run_dir) as server: server.url`` — stops the server on exit."""

    def __init__(self, spec: ServerSpec, run_dir: Path) -> None:
        self.spec = spec
        self.run_dir = run_dir
        self.port = free_port()
        self.log_path = run_dir / "server.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._rpc_dir: Path | None = None

    @property
    def rpc_dir(self) -> Path:
        """vLLM's IPC socket folder: short, whatever ``run_dir`` is (a Unix socket path has 107 bytes)."""
        if self._rpc_dir is None:
            self._rpc_dir = Path(tempfile.mkdtemp(prefix="lmi-rpc-"))
        return self._rpc_dir

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        spec = self.spec
        args = [
            spec.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(spec.model_dir),
            "--served-model-name", spec.served_model_name,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--enforce-eager", "--dtype", "float32",
            "--max-model-len", str(spec.max_model_len),
            "--enable-prefix-caching" if spec.prefix_caching else "--no-enable-prefix-caching",
        ]
        if spec.kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(spec.kv_transfer_config)]
        return args + spec.extra_args

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(self.spec.kvcache_space_gib),
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_CACHE_ROOT=str(self.run_dir / "vllm-cache"),
            VLLM_RPC_BASE_PATH=str(self.rpc_dir),
            # No phoning home and no hub look-ups from a machine without network.
            VLLM_NO_USAGE_STATS="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
        )
        env.pop("LMCACHE_CONFIG_FILE", None)
        if self.spec.lmcache_config_file is not None:
            env["LMCACHE_CONFIG_FILE"] = str(self.spec.lmcache_config_file)
        env.update(self.spec.extra_env)
        return env

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            # Own session: stop() can signal the server and its engine workers as a group.
            self._process = subprocess.Popen(
                self.command(), env=self.environment(), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()  # engine processes of a failed start must not linger
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.spec.ready_timeout_s
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                cause = first_error(self.log_path) or "no exception in the log"
                raise ServerStartError(
                    f"vLLM server exited with {self._process.returncode} during start-up ({cause}); see {self.log_path}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise ServerStartError(f"vLLM server not ready after {self.spec.ready_timeout_s:.0f}s; see {self.log_path}")

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM (vLLM shuts its engine down cleanly, connectors flush), then SIGKILL."""
        process, self._process = self._process, None
        try:
            if process is not None:
                _end_process_group(process, grace_s)
        finally:
            if self._rpc_dir is not None:
                shutil.rmtree(self._rpc_dir, ignore_errors=True)
                self._rpc_dir = None

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _end_process_group(process: subprocess.Popen[bytes], grace_s: float) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=grace_s)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
    # Also when the server itself already exited: its engine processes share its group.
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=10)
