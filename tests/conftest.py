"""Shared test fixtures: the shared data folder beside the repo, the ShareGPT prompts, the model and its tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


def sharegpt_prompts(n: int | None = None) -> list[str]:
    """The first n prompts of ../shared/data/sharegpt_prompts.jsonl (fails loudly if absent)."""
    path = SHARED_DATA / "sharegpt_prompts.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: tests read the shared data beside the repository")
    prompts = []
    with path.open() as f:
        for line in f:
            prompts.append(json.loads(line)["prompt"])
            if n is not None and len(prompts) == n:
                break
    return prompts


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    return SHARED_DATA


@pytest.fixture(scope="session")
def model_path() -> Path:
    """HF-layout directory of the bundled SmolLM2-135M-Instruct (imported from its GGUF once)."""
    from engine.model_loader import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tokenizer(model_path):
    """The bundled model's HF tokenizer."""
    from engine.model_loader import load_tokenizer

    return load_tokenizer(model_path)


# -- Ray: one local cluster per test session (serving tests) ---------------------------------
def _outside_loopback_namespace() -> list[str]:
    """Network interfaces other than lo (Ray must run in a loopback-only namespace here)."""
    import socket

    return [name for _, name in socket.if_nameindex() if name != "lo"]


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    """A local Ray (dashboard off, auth off, temp dir under pytest's), shared by the whole session.

    Fails (never skips) outside a loopback-only network namespace: run the suite with `make test`
    or `unshare -n bash -c 'ip link set lo up && exec .venv/bin/python -m pytest ...'`.
    """
    import os

    others = _outside_loopback_namespace()
    if others:
        pytest.fail(f"Ray tests must run in a loopback-only network namespace (found {others}); use make test")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_TMPDIR"] = str(tmp_path_factory.mktemp("ray"))
    import ray

    from deploy.cluster import init_ray

    init_ray(num_cpus=8)
    yield ray
    ray.shutdown()


# -- Redis: one real redis-server per test session (registry, KV events) -----------------------
@pytest.fixture(scope="session")
def redis_server():
    """A redis-server on a free 127.0.0.1 port, no persistence; stopped at the end of the session.
    Tests that kill Redis start their own `tests.redis_server.RedisServer` instead."""
    from tests.redis_server import RedisServer

    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_client(redis_server):
    """A redis-py client on the session server, its database flushed before the test."""
    import redis

    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture(scope="session")
def amx_int8() -> None:
    """Skips, with the reason, on a CPU without AMX-INT8; fails where the CPU has it but the AMX
    INT8 kernel (kernels/csrc/int8_gemm_amx.cpp) did not build."""
    import torch

    from engine.platform import cpu_flags
    from kernels.linear import MX_GROUP, Int8Linear

    layer = Int8Linear(torch.zeros(16, 64, dtype=torch.bfloat16), None, group=MX_GROUP)
    if "w8a8_amx" not in layer._candidates():
        assert not {"amx_int8", "amx_tile", "avx512_bf16"} <= cpu_flags(), "AMX-INT8 CPU but the AMX kernel did not build"
        pytest.skip("no AMX-INT8 on this CPU")
