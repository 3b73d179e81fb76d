"""The Triton kernels (kernels/triton/) under the interpreter, in a child process.

TRITON_INTERPRET=1 must be set before triton is imported and changes how every kernel is
compiled, so tests/triton_interp_cases.py runs once in its own pytest process (module fixture)
and each test here checks one kernel family's cases there: at least one ran, none failed or
was skipped (triton installs on CPU, so nothing may skip).
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CASES = "tests/triton_interp_cases.py"


@pytest.fixture(scope="module")
def interpreter_run(tmp_path_factory):
    """{case name: (outcome, message)} of one child pytest over the interpreter cases, its output
    and exit status."""
    report = tmp_path_factory.mktemp("triton") / "cases.xml"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", CASES, "-q", "-p", "no:cacheprovider",
                           f"--junitxml={report}"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    outcomes = {}
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            result = next(iter(case), None)        # <failure>, <error>, <skipped> or nothing (passed)
            outcomes[case.get("name")] = ("passed", "") if result is None else (
                result.tag, (result.get("message") or "")[:2000])
    return outcomes, proc.stdout[-4000:] + proc.stderr[-2000:], proc.returncode


FAMILIES = [
    "test_decode_attention",     # split-K paged decode attention: dtypes, FP8 scales, GQA, splits, bad input
    "test_fp8_decode",           # FP8 attention against unquantized K/V
    "test_backend",              # the "triton" backend against the "torch" one (ops, and inside the model)
    "test_fp8_gemm",             # FP8 GEMM, per-token x per-channel scales: out dtypes, bias, edges, bad input
    "test_fp8_linear",           # FP8 linear against the fp32 linear
    "test_rms_norm",             # RMSNorm and fused add + RMSNorm: dtypes, the model's layer, bad input
]


@pytest.mark.parametrize("family", FAMILIES)
def test_interpreter_cases(interpreter_run, family):
    outcomes, output, _ = interpreter_run
    mine = {name: result for name, result in outcomes.items() if name.startswith(family)}
    assert mine, f"no {family}* case ran in {CASES}:\n{output}"
    bad = {name: result for name, result in mine.items() if result[0] != "passed"}
    assert not bad, f"{len(bad)} of {len(mine)} {family}* cases did not pass: {bad}\n{output}"


def test_every_case_belongs_to_a_family(interpreter_run):
    outcomes, output, returncode = interpreter_run
    assert outcomes and returncode == 0, f"child pytest exited {returncode}:\n{output}"
    orphans = [name for name in outcomes if not name.startswith(tuple(FAMILIES))]
    assert not orphans, f"cases no family test checks: {orphans}"
