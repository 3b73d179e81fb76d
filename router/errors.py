"""The router's error taxonomy: one exception carrying a gRPC status code, mapped to HTTP."""

from __future__ import annotations

import grpc

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


class ServiceError(Exception):
    """A request failed with a status the client sees (gRPC code, or its HTTP equivalent)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def http_status(self) -> int:
        return HTTP_STATUS.get(self.code, 500)

    @classmethod
    def from_rpc(cls, err: grpc.RpcError, leg: str) -> "ServiceError":
        """A worker's failure as seen by the client: client errors pass through, the rest are UNAVAILABLE."""
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNAVAILABLE
        details = err.details() if hasattr(err, "details") else str(err)
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                    grpc.StatusCode.DEADLINE_EXCEEDED):
            return cls(code, details)
        return cls(grpc.StatusCode.UNAVAILABLE, f"{leg} worker failed ({code.name}): {details}")
