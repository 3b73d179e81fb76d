"""engine/platform.py: dtype resolution from CPU flags (given, so every machine tests every
branch), core assignment, sizes, and binding a real process to a core. Pure except the last."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine import platform
from engine.errors import UserError

ZEN5 = {"avx2", "avx512f", "avx512_bf16", "avx_vnni"}          # 2026-12-01 machines
AVX2_ONLY = {"avx2", "fma"}                                   # 2026-11-30 machines
SAPPHIRE = {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"}
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flags, expected", [(ZEN5, "bfloat16"), (SAPPHIRE, "bfloat16"), (AVX2_ONLY, "float32"),
                                             (set(), "float32"), ({"fp", "asimd", "bf16"}, "bfloat16")])
def test_auto_is_bf16_only_with_native_bf16_dot_products(flags, expected):
    assert platform.resolve_dtype_name("auto", "cpu", flags=flags) == expected


def test_explicit_dtypes_and_what_is_refused():
    assert platform.resolve_dtype_name("float32", "cpu", flags=AVX2_ONLY) == "float32"
    # bf16 without native support is allowed (emulated: slower, still right)
    assert platform.resolve_dtype_name("bfloat16", "cpu", flags=AVX2_ONLY) == "bfloat16"
    assert platform.resolve_dtype_name("float16", "cpu", flags=SAPPHIRE) == "float16"
    with pytest.raises(UserError, match=r"--dtype float16: .*avx512_bf16.*use auto, float32 or bfloat16"):
        platform.resolve_dtype_name("float16", "cpu", flags=ZEN5)
    with pytest.raises(UserError, match=r"--dtype 'fp8': expected one of auto, float32, bfloat16, float16"):
        platform.resolve_dtype_name("fp8", "cpu", flags=ZEN5)


def test_resolve_dtype_gives_torch_dtypes_and_reason():
    import torch

    assert platform.resolve_dtype("auto", "cpu", flags=ZEN5) is torch.bfloat16
    assert platform.resolve_dtype("auto", "cpu", flags=AVX2_ONLY) is torch.float32
    assert "avx512_bf16" in platform.dtype_reason("auto", "bfloat16", flags=ZEN5)
    assert platform.dtype_reason("float32", "float32") == "as asked"


def test_cpu_isa_levels():
    assert platform.cpu_isa(SAPPHIRE) == "amx_bf16"
    assert platform.cpu_isa(ZEN5) == "avx512_bf16"
    assert platform.cpu_isa({"avx2", "avx512f"}) == "avx512f"
    assert platform.cpu_isa(AVX2_ONLY) == "avx2"


def test_cpu_flags_parses_x86_and_arm(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert platform.cpu_flags(x86) == {"fpu", "avx2", "avx512_bf16"}
    assert platform.cpu_flags(arm) == {"fp", "asimd", "bf16"}
    assert platform.cpu_flags(tmp_path / "missing") == frozenset()


def test_assign_cores_default_divides_cores_and_never_shares():
    a = platform.assign_cores(2, None, [0, 1, 2, 3])
    assert a.threads == 2 and a.cores == ((0, 1), (2, 3)) and not a.shared
    b = platform.assign_cores(1, None, [4, 5])
    assert b.threads == 2 and b.cores == ((4, 5),)
    c = platform.assign_cores(3, None, [0, 1, 2, 3])
    assert c.threads == 1 and c.cores == ((0,), (1,), (2,))
    explicit = platform.assign_cores(2, 1, [0, 1, 2, 3])
    assert explicit.cores == ((0,), (1,))


def test_assign_cores_more_workers_than_cores_shares_one_thread_each():
    a = platform.assign_cores(3, None, [0, 1])
    assert a.shared and a.threads == 1 and a.cores == ((0,), (1,), (0,))


def test_too_many_threads_is_a_user_error_naming_the_option():
    with pytest.raises(UserError, match=r"--threads-per-worker 2: 2 worker\(s\) x 2 threads need 4 cores, "
                                        r"2 are available \(cores 0-1\); use at most 1"):
        platform.assign_cores(2, 2, [0, 1])
    with pytest.raises(UserError, match="--threads-per-worker 0"):
        platform.assign_cores(1, 0, [0, 1])
    with pytest.raises(UserError, match=r"--threads 3: must be in \[1, 2\]"):
        platform.check_threads(3, [0, 1])
    assert platform.check_threads(None, [0, 1]) == 2


def test_sizes():
    assert platform.parse_bytes("2GiB") == 2 * 2**30
    assert platform.parse_bytes("512 MiB") == 512 * 2**20
    assert platform.parse_bytes("1.5GB") == 1_500_000_000
    assert platform.parse_bytes("4096") == 4096
    for bad in ("", "-1GiB", "two", "3 parsecs", "0"):
        with pytest.raises(UserError, match="--kv-cache-memory .*expected a size such as 2GiB"):
            platform.parse_bytes(bad)
    assert platform.format_cores([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_available_memory(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24000000 kB\nMemAvailable:    1000 kB\n")
    assert platform.available_memory_bytes(f) == 1000 * 1024
    assert platform.available_memory_bytes(tmp_path / "missing") is None


def test_bind_to_cores_pins_every_thread_of_the_process():
    """In a child process (the test process keeps its affinity): threads that exist before
    binding (torch's pool after a parallel op) and after it all run on the one core."""
    core = platform.available_cores()[-1]
    code = f"""
import os, threading, torch
torch.set_num_threads(2); torch.randn(256, 256) @ torch.randn(256, 256)   # start the OpenMP pool
from engine.platform import bind_to_cores
bind_to_cores([{core}], 1)
t = threading.Thread(target=lambda: None); t.start(); t.join()
masks = {{tid: os.sched_getaffinity(int(tid)) for tid in os.listdir('/proc/self/task')}}
assert all(m == {{{core}}} for m in masks.values()), masks
assert torch.get_num_threads() == 1
print('ok', len(masks))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok")
