"""Regenerate the committed protobuf/gRPC Python code from proto/pdserve/v1/*.proto.

    python -m proto.regen            # rewrite the generated files in place
    python -m proto.regen --check    # exit 1 if regenerating would change anything

Files are compiled from the repository root (``-I .``) so the generated imports read
``from proto.pdserve.v1 import api_pb2``, which works wherever the repository is importable.
The check ignores the lines where the generator stamps its own version (grpcio-tools'
``GRPC_GENERATED_VERSION``, protobuf's ``Protobuf Python Version`` and runtime-version check):
a patch release of grpcio-tools changes them and nothing else (1.85.1 -> 1.85.4 made a fresh
clone's CI fail, 2026-12-06), and pyproject.toml's grpcio/protobuf floors keep the committed
stamps satisfiable at run time.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = Path("proto") / "pdserve" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted((REPO_ROOT / PROTO_DIR).glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Compile every .proto into out_root (mirroring proto/pdserve/v1); return the files written.

    protoc runs in a child process: grpc_tools' extension crashed (SIGSEGV) when loaded into a
    process that already holds torch and nixl, as a full test session does.
    """
    import grpc_tools  # build-time dependency only

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = [sys.executable, "-m", "grpc_tools.protoc", "-I.", f"-I{include}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}"]
    args += [str(p.relative_to(REPO_ROOT)) for p in proto_files()]
    done = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"protoc failed ({done.returncode}): {done.stderr.strip()}")
    return sorted(p for p in (out_root / PROTO_DIR).iterdir() if p.name.endswith(GENERATED_SUFFIXES))


VERSION_STAMPS = re.compile(
    r"^GRPC_GENERATED_VERSION = '[^']*'$"                                     # grpcio-tools
    r"|^# Protobuf Python Version: .*$"                                       # protobuf, the header
    r"|(?<=ValidateProtobufRuntimeVersion\(\n    _runtime_version\.Domain\.PUBLIC,\n)(    \d+,\n){3}",
    re.MULTILINE)


def without_version_stamps(text: str) -> str:
    """Generated code with the generator's version stamps blanked (see the module docstring)."""
    return VERSION_STAMPS.sub("<version>", text)


def differences() -> list[str]:
    """Generated files that differ from (or are missing in) the committed tree, version stamps aside."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        diffs = []
        for f in fresh:
            committed = REPO_ROOT / PROTO_DIR / f.name
            if not committed.exists() or without_version_stamps(f.read_text()) != without_version_stamps(
                    committed.read_text()):
                diffs.append(f.name)
        return diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only check, exit 1 on a difference")
    args = ap.parse_args()
    if args.check:
        diffs = differences()
        for d in diffs:
            print(f"stale generated file: {PROTO_DIR / d}", file=sys.stderr)
        return 1 if diffs else 0
    generate(REPO_ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
