"""The torch-free protocol layer (proto/): one set of sampling rules, the wire converter, and the
rule that importing it (and the router) never imports torch. No model, no network."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from proto.pdserve.v1 import api_pb2
from proto.sampling import InvalidRequest, SamplingParams, check_prompt, from_wire, to_wire

REPO = Path(__file__).resolve().parents[1]


def test_importing_the_protocol_layer_and_the_router_does_not_import_torch():
    code = ("import sys, pkgutil, importlib, proto, router; "
            "[importlib.import_module(m.name) for p in (proto, router) "
            " for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.')]; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(logprobs=21), "logprobs"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids"),
    (dict(stop=tuple(str(i) for i in range(17))), "stop"),
    (dict(stop=("",)), "stop"),
    (dict(stop=("x" * 257,)), "stop"),
])
def test_bad_sampling_names_the_field(kwargs, field):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field and str(e.value).startswith(f"{field}: ")


def test_bad_wire_options_fail_with_the_same_rule():
    with pytest.raises(InvalidRequest, match="^top_p"):
        from_wire(api_pb2.SamplingOptions(top_p=0.0))


def test_wire_round_trip_keeps_every_field():
    # values exact in float32: the wire carries float
    p = SamplingParams(temperature=0.5, top_k=3, top_p=0.75, seed=7, max_tokens=5, stop_token_ids=[4, 5],
                       stop=["\n\n"], ignore_eos=True)
    assert from_wire(to_wire(p)) == p
    assert from_wire(to_wire(p), max_tokens=1).max_tokens == 1
    assert from_wire(api_pb2.SamplingOptions()) == SamplingParams()


def test_prompt_rules():
    with pytest.raises(InvalidRequest, match="^prompt"):
        check_prompt([], 4, 100)
    with pytest.raises(InvalidRequest, match=r"^prompt: token ids must be in \[0, 10\)"):
        check_prompt([3, 10], 4, 100, vocab_size=10)
    with pytest.raises(InvalidRequest, match="^max_tokens.*context length 100"):
        check_prompt([1] * 90, 11, 100)
    check_prompt([1] * 90, 10, 100, vocab_size=10)
