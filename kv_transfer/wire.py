"""The framed protocol of the ``tcp`` and ``torch`` backends: a fixed ``struct`` header, then a body.

Every frame is ``HEADER`` (36 bytes, little-endian) followed by ``body_len`` bytes. DATA bodies are
raw tensor bytes (``count * block_bytes``) copied straight into the destination blocks; control
bodies are UTF-8 (notify strings, reasons) or JSON (HELLO) and are bounded by ``MAX_CONTROL_BODY``.
Nothing is ever unpickled.

=========  =======================================================================================
kind       meaning
=========  =======================================================================================
HELLO      tcp handshake; body: JSON ``{"compat": ..., "num_blocks": n, "peer_id": ...}``
REFUSE     handshake refused; body: the reason (names both sides' values)
BEGIN      a data stream starts; ``tid``; body: the notify string (empty for read responses)
DATA       blocks ``start .. start+count-1`` of K (kv=0) or V (kv=1) of ``layer`` at the receiver
END        the stream ``tid`` is complete: the receiver delivers the notify string, then ACKs
ABORT      the stream ``tid`` stops here (cancel or timeout): nothing more of it will come
ACK        the receiver has everything of ``tid`` (status DONE) or saw its ABORT (status CANCELLED)
READ       pull request ``tid``; body: ``n`` packed descriptors then the notify string
NOTIFY     a standalone notification; body: the message
BYE        orderly close
=========  =======================================================================================
``FLAG_READ`` marks frames that belong to a read (pull): the data stream of a read response and
the requester's ACK of it. ``FLAG_STOP`` marks the requester's ABORT asking the source to stop
serving its read (the source then ends the stream with an ABORT of its own). ``FLAG_FENCED`` marks
the receiver's ACK (status CANCELLED) of a write it discarded because the reservation its notify
tag names is no longer live (``fence``).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Sequence

from kv_transfer.plan import Desc

HEADER = struct.Struct("<BBxxQiiiiQ")
DESC = struct.Struct("<iiiii")
MAX_CONTROL_BODY = 1 << 20
FLAG_READ = 1
FLAG_STOP = 2
FLAG_FENCED = 4


class Kind(enum.IntEnum):
    HELLO = 1
    REFUSE = 2
    BEGIN = 3
    DATA = 4
    END = 5
    ABORT = 6
    ACK = 7
    READ = 8
    NOTIFY = 9
    BYE = 10


class ProtocolError(Exception):
    """The peer sent something malformed or out of range; the connection is dropped."""


@dataclass(frozen=True)
class Header:
    kind: Kind
    tid: int = 0
    layer: int = 0
    kv: int = 0
    start: int = 0
    count: int = 0
    body_len: int = 0
    flags: int = 0

    def pack(self) -> bytes:
        return HEADER.pack(self.kind, self.flags, self.tid, self.layer, self.kv, self.start, self.count,
                           self.body_len)

    @classmethod
    def unpack(cls, raw: bytes) -> "Header":
        kind, flags, tid, layer, kv, start, count, body_len = HEADER.unpack(raw)
        try:
            kind = Kind(kind)
        except ValueError:
            raise ProtocolError(f"unknown frame kind {kind}") from None
        if kind is not Kind.DATA and body_len > MAX_CONTROL_BODY:
            raise ProtocolError(f"{kind.name} frame body of {body_len} bytes exceeds {MAX_CONTROL_BODY}")
        return cls(kind, tid, layer, kv, start, count, body_len, flags)


def pack_descs(descs: Sequence[Desc]) -> bytes:
    return b"".join(DESC.pack(d.layer, d.kv, d.src, d.dst, d.count) for d in descs)


def unpack_descs(raw: bytes, n: int) -> list[Desc]:
    if n < 0 or len(raw) < n * DESC.size:
        raise ProtocolError(f"READ frame announces {n} descriptors but carries {len(raw)} bytes")
    return [Desc(*DESC.unpack_from(raw, i * DESC.size)) for i in range(n)]
