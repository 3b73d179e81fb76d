"""pdserve status: the cluster's workers with their KV usage and queues, from the router.

A router serving TLS (`pdserve serve --tls-cert C --tls-key K`): `--tls-ca C` (the CA that signed
C; for a self-signed certificate, C itself), or a grpcs:// --url to verify against the system's
roots. A router with --api-key: `--api-key KEY` or $PDSERVE_API_KEY.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

TLS_CA_HELP = ("CA (PEM) to verify the router's --tls-cert against (a self-signed one: that certificate); "
               "connects over TLS.")
API_KEY_HELP = "The router's --api-key (default: $PDSERVE_API_KEY)."


def command(
    url: str = typer.Option("127.0.0.1:50051", help="Router gRPC address (grpcs://HOST:PORT: TLS, system roots)."),
    json_output: bool = typer.Option(False, "--json", help="Print JSON: {\"workers\": [...]}."),
    timeout: float = typer.Option(5.0, help="Seconds to wait for the router."),
    tls_ca: Optional[Path] = typer.Option(None, "--tls-ca", help=TLS_CA_HELP),
    api_key: Optional[str] = typer.Option(None, "--api-key", help=API_KEY_HELP),
) -> None:
    """pdserve status: workers with their KV usage and queues."""
    import json

    import grpc

    from engine.errors import UserError
    from router.auth import resolve_api_key
    from router.client import RouterClient

    try:
        client = RouterClient(url, timeout_s=timeout, tls_ca=tls_ca, api_key=resolve_api_key(api_key))
    except OSError as e:
        raise UserError(f"--tls-ca: cannot read {str(tls_ca)!r}: {e.strerror}") from None
    try:
        with client:
            status = client.cluster_status()
    except grpc.RpcError as e:
        raise UserError(f"cannot reach the router at {url}: {e.code().name}: {e.details()}"
                        f"{connect_hint(e.code(), url, tls_ca)}") from None
    workers = [{"id": w.id, "role": w.role, "kv_blocks_used": w.kv_blocks_used, "kv_blocks_total": w.kv_blocks_total,
                "running": w.running, "waiting": w.waiting, "spec_draft_tokens": w.spec_draft_tokens,
                "spec_accepted_tokens": w.spec_accepted_tokens, "spec_acceptance_rate": acceptance_rate(w)}
               for w in status.workers]
    if json_output:
        print(json.dumps({"workers": workers}))
        return
    print(f"{'id':<12} {'role':<8} {'alive':<6} {'address':<22} {'kv used/total':>14} {'held':>5} {'running':>8} "
          f"{'waiting':>8} {'spec accept':>12}")
    for w in status.workers:
        rate = acceptance_rate(w)
        accept = "-" if rate is None else f"{rate * 100:.1f}%"
        print(f"{w.id:<12} {w.role:<8} {'yes' if w.alive else 'no':<6} {w.address:<22} "
              f"{f'{w.kv_blocks_used}/{w.kv_blocks_total}':>14} {w.kv_blocks_held:>5} {w.running:>8} {w.waiting:>8} "
              f"{accept:>12}")


def acceptance_rate(w) -> float | None:
    """Accepted / verified draft tokens of one worker since it started; None when it verified none
    (speculation off, or no decode step speculated yet)."""
    return w.spec_accepted_tokens / w.spec_draft_tokens if w.spec_draft_tokens else None


def connect_hint(code, url: str, tls_ca) -> str:
    """What the user may have left out, for a failed call's status code."""
    import grpc

    if code == grpc.StatusCode.UNAUTHENTICATED:
        return " (pass --api-key or set $PDSERVE_API_KEY)"
    if code == grpc.StatusCode.UNAVAILABLE and tls_ca is None and not url.startswith("grpcs://"):
        return " (if the router serves TLS, pass --tls-ca)"
    return ""
