"""The model files a router needs to tokenize, sent by a worker over its API (Worker.ModelFiles).

The router never reads a worker's disk: it may run on another node. A worker streams the files
below from its resolved HF-layout model directory (those it has) as ``FileChunk`` messages of at
most CHUNK_BYTES each, so a large tokenizer.json never exceeds gRPC's 4 MiB message limit; the
router joins the chunks by name. Pure Python, no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

from proto.pdserve.v1 import worker_pb2

# what the router uses: the tokenizer, its config (special tokens, chat template), the chat
# template file, and the sampling defaults (--generation-config auto)
MODEL_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
CHUNK_BYTES = 1 << 20


def file_chunks(model_dir: str | Path, chunk_bytes: int = CHUNK_BYTES) -> Iterator[worker_pb2.FileChunk]:
    """The MODEL_FILES that exist in model_dir, each as one or more chunks in order."""
    for name in MODEL_FILES:
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        for start in range(0, max(len(data), 1), chunk_bytes):
            yield worker_pb2.FileChunk(name=name, data=data[start:start + chunk_bytes])


def join_chunks(chunks: Iterable[worker_pb2.FileChunk]) -> dict[str, bytes]:
    """name -> file contents; a name outside MODEL_FILES raises ValueError (a confused peer)."""
    parts: dict[str, list[bytes]] = {}
    for c in chunks:
        if c.name not in MODEL_FILES:
            raise ValueError(f"unexpected model file {c.name!r} from the worker")
        parts.setdefault(c.name, []).append(c.data)
    return {name: b"".join(p) for name, p in parts.items()}
