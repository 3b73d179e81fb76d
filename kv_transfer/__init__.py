"""KV transfer: move paged-KV-cache blocks between prefill and decode workers.

One interface (``KVTransport``, ``TransferHandle``, ``CompatKey`` in ``base``), four backends chosen
by name (``--kv-transport nixl|torch|tcp|local``), receiver-side landing tracking (``landing``) and
source-side leases (``leases``), layer-wise streaming from the model runner's hook (``stream``).
Knows nothing of routing, gRPC or HTTP.
"""

from __future__ import annotations

from typing import Any

from kv_transfer.base import (ABORTED_PREFIX, PROTOCOL_VERSION, CompatKey, IncompatiblePeer, KVTransferError,
                              KVTransport, TransferHandle, TransferState, TransportUnavailable, UnknownPeer)
from kv_transfer.landing import LandingTracker, layers_tag, parse_tag
from kv_transfer.leases import Lease, LeaseTable
from kv_transfer.stream import LayerStream

BACKENDS = ("nixl", "torch", "tcp", "local")


def create_transport(name: str, **opts: Any) -> KVTransport:
    """A transport by backend name; ``opts`` go to its constructor.

    - ``nixl``: ``NixlTransport(agent_name=None, ucx_devices="")``
    - ``torch``: ``TorchDistTransport(host="127.0.0.1", port=0, connect_timeout_s=30.0)``
    - ``tcp``: ``TcpTransport(host="127.0.0.1", port=0, connect_timeout_s=10.0)``
    - ``local``: ``LocalTransport()``

    Raises ValueError for an unknown name and ``TransportUnavailable`` when the backend's package
    or hardware is missing (checked here, at start-up, not at the first transfer).
    """
    if name == "nixl":
        from kv_transfer.nixl import NixlTransport
        return NixlTransport(**opts)
    if name == "torch":
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_gloo_available():
            raise TransportUnavailable("kv transport 'torch' needs torch.distributed with gloo (or NCCL on GPUs)")
        from kv_transfer.torch_dist import TorchDistTransport
        return TorchDistTransport(**opts)
    if name == "tcp":
        from kv_transfer.tcp import TcpTransport
        return TcpTransport(**opts)
    if name == "local":
        from kv_transfer.local import LocalTransport
        return LocalTransport(**opts)
    raise ValueError(f"unknown kv transport {name!r}; choose one of {', '.join(BACKENDS)}")


__all__ = ["ABORTED_PREFIX", "BACKENDS", "PROTOCOL_VERSION", "CompatKey", "IncompatiblePeer", "KVTransferError",
           "KVTransport", "LandingTracker", "LayerStream", "Lease", "LeaseTable", "TransferHandle", "TransferState",
           "TransportUnavailable", "UnknownPeer", "create_transport", "layers_tag", "parse_tag"]
