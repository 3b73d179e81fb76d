"""`pdserve serve` as a subprocess: becomes healthy, answers, exits cleanly on SIGINT, and leaves
no process behind (every descendant, Ray's included, is found by an environment marker).
It runs with a real Redis registry and `--routers 2`: both replicas answer, and a third router
started on its own (`pdserve router --registry`) serves too; killed (SIGKILL), it leaves the
others serving."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.model]

REPO = Path(__file__).resolve().parents[1]
PDSERVE = Path(sys.executable).parent / "pdserve"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_port_pair() -> int:
    """A port p with p and p + 1 free (--routers 2 takes the next port for its second replica)."""
    for _ in range(100):
        p = _free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports")


def _wait_serving(client, proc, end: float, log: Path) -> None:
    while proc.poll() is None and time.monotonic() < end:
        try:
            client.wait_ready(2)
            return
        except TimeoutError:
            pass
    pytest.fail(f"not serving (exit code {proc.poll()}); log:\n" + log.read_text()[-4000:])


def _answer(address: str) -> str:
    from router.client import RouterClient

    with RouterClient(address, timeout_s=60) as client:
        text = "".join(m.text for m in client.generate("What is 2+2?", chat=True, max_tokens=8, temperature=0.0))
    assert text.strip(), address
    return text


def _processes_with(marker: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker.encode() in (d / "environ").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def test_serve_subprocess_health_answer_sigint(tmp_path):
    from tests.conftest import _outside_loopback_namespace

    assert not _outside_loopback_namespace(), "run inside a loopback-only namespace (make test)"
    from tests.redis_server import RedisServer

    grpc_port, http_port, metrics_port, extra_port = _free_port_pair(), _free_port_pair(), _free_port(), _free_port()
    marker = f"PDSERVE_TEST_MARKER={uuid.uuid4().hex}"
    import tempfile

    ray_tmp = tempfile.mkdtemp(prefix="pdr-", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    env = dict(os.environ, RAY_TMPDIR=ray_tmp, RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1",
               PDSERVE_TEST_MARKER=marker.split("=", 1)[1])
    env.pop("RAY_ADDRESS", None)
    redis = RedisServer()
    redis.start()
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([str(PDSERVE), "serve", "--mode", "disagg", "--prefill", "1", "--decode", "1", "--port", str(grpc_port),
                             "--http-port", str(http_port), "--metrics-port", str(metrics_port),
                             "--num-blocks", "256", "--registry", redis.url, "--routers", "2",
                             "--internal-secret-file", str(tmp_path / "secret")],  # created: the extra router reads it
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    extra = None
    try:
        from router.client import RouterClient

        end = time.monotonic() + 300
        for port in (grpc_port, grpc_port + 1):
            with RouterClient(f"127.0.0.1:{port}", timeout_s=60) as client:
                _wait_serving(client, proc, end, tmp_path / "serve.log")
        text = _answer(f"127.0.0.1:{grpc_port}")
        status = subprocess.run([str(PDSERVE), "status", "--url", f"127.0.0.1:{grpc_port}", "--json"], env=env,
                                capture_output=True, text=True, timeout=60)
        workers = json.loads(status.stdout)["workers"]
        assert sorted(w["role"] for w in workers) == ["decode", "prefill"]
        assert all(set(w) == {"id", "role", "kv_blocks_used", "kv_blocks_total", "running", "waiting", "spec_draft_tokens",
                               "spec_accepted_tokens", "spec_acceptance_rate"} and
                   w["kv_blocks_total"] == 256 for w in workers)
        import httpx

        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        assert 'pdserve:time_to_first_token_seconds_count{model_name="smollm2-135m-instruct"} 1.0' in metrics
        out = (tmp_path / "serve.log").read_text()
        assert f"127.0.0.1:{grpc_port}" in out and f"127.0.0.1:{grpc_port + 1}" in out and "ready" in out
        assert _answer(f"127.0.0.1:{grpc_port + 1}") == text  # the second replica: same cluster, same greedy text
        extra_log = tmp_path / "router.log"
        extra = subprocess.Popen([str(PDSERVE), "router", "--registry", redis.url, "--mode", "disagg", "--port",
                                  str(extra_port), "--http-port", "-1", "--internal-secret-file",
                                  str(tmp_path / "secret")], cwd=REPO, env=env,
                                 stdout=extra_log.open("w"), stderr=subprocess.STDOUT)
        with RouterClient(f"127.0.0.1:{extra_port}", timeout_s=60) as client:
            _wait_serving(client, extra, time.monotonic() + 120, extra_log)
        assert _answer(f"127.0.0.1:{extra_port}") == text
        extra.kill()  # one router dies: the others serve on
        extra.wait(30)
        for port in (grpc_port, grpc_port + 1):
            assert _answer(f"127.0.0.1:{port}") == text
    finally:
        if extra is not None and extra.poll() is None:
            extra.kill()
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        finally:
            redis.__exit__(None, None, None)
    assert rc == 0, (tmp_path / "serve.log").read_text()[-3000:]
    end = time.monotonic() + 30
    while (left := [p for p in _processes_with(marker) if p != os.getpid()]) and time.monotonic() < end:
        time.sleep(0.5)
    assert not left, f"processes left behind: {left}"
    assert "pdserve: stopped" in (tmp_path / "serve.log").read_text()
