"""The wire API: committed generated code is current, messages round-trip, no torch."""

from __future__ import annotations

import subprocess
import sys

from proto import regen


def test_regenerating_changes_nothing():
    assert regen.differences() == []


def test_generate_request_round_trips_with_optional_fields():
    from proto.pdserve.v1 import api_pb2

    req = api_pb2.GenerateRequest(model="m", prompt="hi",
                                  sampling=api_pb2.SamplingOptions(temperature=0.0, max_tokens=4, stop=["\n"]))
    back = api_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert back.WhichOneof("input") == "prompt"
    assert back.sampling.HasField("temperature") and back.sampling.temperature == 0.0
    assert not back.sampling.HasField("top_p")
    assert list(back.sampling.stop) == ["\n"]


def test_importing_the_generated_code_does_not_import_torch():
    code = ("import sys; from proto.pdserve.v1 import api_pb2_grpc, worker_pb2_grpc; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=regen.REPO_ROOT)
