"""A throwaway loopback redis-server process for tests and benchmarks (test/benchmark process).

Starts Debian's ``redis-server`` on a free 127.0.0.1 port it picked itself
(persistence off), waits for PING, and can pause (SIGSTOP), resume, kill and
restart it on the same port to exercise the remote tier's fault handling.
It only ever signals the process it started.
"""
from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def redis_server_binary() -> str | None:
    return shutil.which("redis-server") or shutil.which("valkey-server")


class RedisServer:
    """One redis-server child process on 127.0.0.1:<port> (``with`` stops it)."""

    def __init__(self, extra_args: list[str] | None = None, password: str | None = None,
                 unix_socket: bool = False, tls_files: tuple[str, str, str] | None = None) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
        self._binary = binary
        self._extra_args = list(extra_args or [])
        self.password = password
        self._dir = Path(tempfile.mkdtemp(prefix="lmi-cache-redis-"))
        self.unix_path = str(self._dir / "redis.sock") if unix_socket else None
        self.tls_files = tls_files  # (certificate, key, CA certificate): also listen for TLS on tls_port
        self.tls_port = 0
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        for _ in range(5):  # another process may take the free port between pick and bind
            port = self.port or free_port()
            args = [self._binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                    "--dir", str(self._dir), "--protected-mode", "no", *self._extra_args]
            if self.password:
                args += ["--requirepass", self.password]
            if self.unix_path:
                args += ["--unixsocket", self.unix_path, "--unixsocketperm", "700"]
            if self.tls_files:
                self.tls_port = self.tls_port or free_port()
                cert, key, ca = self.tls_files
                args += ["--tls-port", str(self.tls_port), "--tls-cert-file", cert, "--tls-key-file", key,
                         "--tls-ca-cert-file", ca, "--tls-auth-clients", "no"]
            self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._wait_ready(port, timeout_s):
                self.port = port
                return self
            self._kill()
        raise RuntimeError("redis-server did not start on a free loopback port")

    def _wait_ready(self, port: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    reply = sock.recv(64)
                    if reply.startswith((b"+PONG", b"-NOAUTH")):
                        return True
            except OSError:
                pass
            time.sleep(0.02)
        return False

    def pause(self) -> None:
        """SIGSTOP: the server accepts connections (kernel backlog) but never answers."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGCONT)

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._proc = None

    def kill(self) -> None:
        """Kill the process (its data is gone: persistence is off); ``start`` brings it back on the same port."""
        self._kill()

    def stop(self) -> None:
        self._kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start() if self._proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
