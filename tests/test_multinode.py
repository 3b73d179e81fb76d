"""Multi-node Ray: a head and two worker nodes started with `ray start` (inside the loopback-only
namespace, like every Ray test here); prefill and decode workers land on the nodes whose custom
resources their role asks for (`--prefill-resources` / `--decode-resources`)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from deploy.serve_cmd import parse_resources
from engine.errors import UserError

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_resource_flags_parse_and_refuse_bad_values():
    assert parse_resources('{"prefill": 1}', "--prefill-resources") == (("prefill", 1.0),)
    assert parse_resources("", "--decode-resources") == ()
    for bad in ("[1]", '{"prefill": 0}', '{"GPU": 1}', "{", "{}"):
        with pytest.raises(UserError, match="--prefill-resources"):
            parse_resources(bad, "--prefill-resources")


@pytest.mark.ray
@pytest.mark.model
def test_roles_land_on_their_labelled_nodes():
    if [n for _, n in socket.if_nameindex() if n != "lo"]:
        pytest.fail("Ray tests must run in a loopback-only network namespace; use make test")
    port = _free_port()
    # A short temp dir (Unix socket paths are limited to 107 bytes) that names only this cluster's
    # processes: `ray stop` would also stop every other Ray on the machine (the suite's own).
    tmp = tempfile.mkdtemp(prefix="pdserve-mn-", dir="/tmp")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": tmp, "PYTHONPATH": str(REPO)}
    common = ["--disable-usage-stats", "--node-ip-address", "127.0.0.1", "--temp-dir", tmp]
    run = lambda *args: subprocess.run([RAY, "start", *args, *common], env=env, check=True,  # noqa: E731
                                       capture_output=True, text=True, timeout=180)
    try:
        run("--head", "--port", str(port), "--num-cpus", "1", "--include-dashboard=false")
        address = f"127.0.0.1:{port}"
        run("--address", address, "--num-cpus", "2", "--resources", '{"prefill": 1}')
        run("--address", address, "--num-cpus", "2", "--resources", '{"decode": 1}')
        out = subprocess.run([sys.executable, str(REPO / "tests" / "multinode_placement.py"), address], env=env,
                             capture_output=True, text=True, timeout=400)
        assert out.returncode == 0, out.stderr[-3000:]
        placement = json.loads(out.stdout.strip().splitlines()[-1])
        assert placement == {"prefill-0": ["prefill"], "decode-0": ["decode"]}
    finally:
        subprocess.run(["pkill", "-KILL", "-f", tmp], capture_output=True, timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)
