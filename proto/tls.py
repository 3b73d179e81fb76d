"""Optional TLS for the public APIs (router gRPC + HTTP) and the internal worker API.

`TlsFiles` names PEM files: the server's certificate chain and private key, and the CA that
clients verify the server against (default: the certificate itself, for a self-signed one).
The certificate must name the address clients dial (for 127.0.0.1 an IP SAN `IP:127.0.0.1`).
Public: `pdserve serve --tls-cert C --tls-key K` serves gRPC and HTTPS with them. Internal:
`--internal-tls-cert C --internal-tls-key K [--internal-tls-ca CA]`: every worker serves its API
over TLS and routers verify it against the CA. Off by default (loopback deployments).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TlsFiles:
    cert_file: str
    key_file: str
    ca_file: str | None = None

    @classmethod
    def from_flags(cls, cert: str | None, key: str | None, ca: str | None = None,
                   prefix: str = "--tls") -> "TlsFiles | None":
        """None when neither file is given; ValueError naming the flag when only one is, or a file
        cannot be read."""
        if not cert and not key:
            if ca:
                raise ValueError(f"{prefix}-ca needs {prefix}-cert and {prefix}-key")
            return None
        if not cert or not key:
            raise ValueError(f"{prefix}-cert and {prefix}-key go together: give both")
        for flag, path in ((f"{prefix}-cert", cert), (f"{prefix}-key", key), (f"{prefix}-ca", ca)):
            if path is not None:
                try:
                    Path(path).read_bytes()
                except OSError as e:
                    raise ValueError(f"{flag}: cannot read {path!r}: {e.strerror}") from None
        return cls(str(cert), str(key), None if ca is None else str(ca))

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes())])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A client's: verify the server against the CA (or the certificate itself)."""
        return grpc.ssl_channel_credentials(root_certificates=Path(self.ca_file or self.cert_file).read_bytes())


def add_port(server, address: str, tls: TlsFiles | None) -> int:
    """Bind address on a grpc(.aio) server, with TLS when given; returns the port (0 = failed)."""
    return server.add_secure_port(address, tls.server_credentials()) if tls else server.add_insecure_port(address)
