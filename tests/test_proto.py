"""The wire API: committed generated code is current, messages round-trip, no torch."""

from __future__ import annotations

import re
import subprocess
import sys

from proto import regen


def test_regenerating_changes_nothing():
    assert regen.differences() == []


def test_only_the_generators_version_stamps_are_ignored():
    committed = (regen.REPO_ROOT / regen.PROTO_DIR / "api_pb2.py").read_text()
    grpc = (regen.REPO_ROOT / regen.PROTO_DIR / "api_pb2_grpc.py").read_text()
    bumped = re.sub(r"GRPC_GENERATED_VERSION = '[^']*'", "GRPC_GENERATED_VERSION = '9.9.9'", grpc)
    assert bumped != grpc and regen.without_version_stamps(bumped) == regen.without_version_stamps(grpc)
    stamped = regen.without_version_stamps(committed)
    assert "Protobuf Python Version" not in stamped and stamped.count("<version>") == 2
    assert regen.without_version_stamps(committed.replace("pdserve.v1.Usage", "pdserve.v1.Usagf")) != stamped


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
