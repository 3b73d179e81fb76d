"""A real redis-server for tests: loopback, a free port, no persistence, stopped afterwards.

    with RedisServer() as r:   # r.url == "redis://127.0.0.1:PORT/0"
        r.kill(); r.start()    # same port again (the Redis-down tests)

`make test` installs the system package when it is missing; a missing binary fails the test
(never skips), naming the install command.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: run `make redis` "
                               "(apt-get update && apt-get install -y redis-server)")
        self.binary = binary
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="pdserve-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start (again) on the same port and wait until it answers PING."""
        import redis

        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=2.0)
        end = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                client.close()
                return
            except (redis.ConnectionError, redis.TimeoutError):  # not up yet / slow to answer on a loaded host
                if self.proc.poll() is not None or time.monotonic() > end:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL (a crash, not a shutdown: nothing is saved, clients see the connection drop)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def __enter__(self) -> "RedisServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
