"""`pdserve serve` as a subprocess: becomes healthy, answers, exits cleanly on SIGINT, and leaves
no process behind (every descendant, Ray's included, is found by an environment marker)."""

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
    grpc_port, http_port, metrics_port = _free_port(), _free_port(), _free_port()
    marker = f"PDSERVE_TEST_MARKER={uuid.uuid4().hex}"
    import tempfile

    ray_tmp = tempfile.mkdtemp(prefix="pdr-", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    env = dict(os.environ, RAY_TMPDIR=ray_tmp, RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1",
               PDSERVE_TEST_MARKER=marker.split("=", 1)[1])
    env.pop("RAY_ADDRESS", None)
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([str(PDSERVE), "serve", "--mode", "disagg", "--prefill", "1", "--decode", "1", "--port", str(grpc_port),
                             "--http-port", str(http_port), "--metrics-port", str(metrics_port),
                             "--num-blocks", "256"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        from router.client import RouterClient

        with RouterClient(f"127.0.0.1:{grpc_port}", timeout_s=60) as client:
            end = time.monotonic() + 300
            while proc.poll() is None and time.monotonic() < end:
                try:
                    client.wait_ready(2)
                    break
                except TimeoutError:
                    pass
            else:
                pytest.fail(f"not serving (exit code {proc.poll()}); log:\n" + (tmp_path / "serve.log").read_text()[-4000:])
            text = "".join(m.text for m in client.generate("What is 2+2?", chat=True, max_tokens=8, temperature=0.0))
            assert text.strip()
        status = subprocess.run([str(PDSERVE), "status", "--url", f"127.0.0.1:{grpc_port}", "--json"], env=env,
                                capture_output=True, text=True, timeout=60)
        workers = json.loads(status.stdout)["workers"]
        assert sorted(w["role"] for w in workers) == ["decode", "prefill"]
        assert all(set(w) == {"id", "role", "kv_blocks_used", "kv_blocks_total", "running", "waiting"} and
                   w["kv_blocks_total"] == 256 for w in workers)
        import httpx

        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        assert 'pdserve:time_to_first_token_seconds_count{model_name="smollm2-135m-instruct"} 1.0' in metrics
        out = (tmp_path / "serve.log").read_text()
        assert f"127.0.0.1:{grpc_port}" in out and "ready" in out
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0, (tmp_path / "serve.log").read_text()[-3000:]
    end = time.monotonic() + 30
    while (left := [p for p in _processes_with(marker) if p != os.getpid()]) and time.monotonic() < end:
        time.sleep(0.5)
    assert not left, f"processes left behind: {left}"
    assert "pdserve: stopped" in (tmp_path / "serve.log").read_text()
