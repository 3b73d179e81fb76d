"""pdserve status: the cluster's workers with their KV usage and queues, from the router."""

from __future__ import annotations

import typer


def command(
    url: str = typer.Option("127.0.0.1:50051", help="Router gRPC address."),
    json_output: bool = typer.Option(False, "--json", help="Print JSON: {\"workers\": [...]}."),
    timeout: float = typer.Option(5.0, help="Seconds to wait for the router."),
) -> None:
    """pdserve status: workers with their KV usage and queues."""
    import json

    import grpc

    from engine.errors import UserError
    from router.client import RouterClient

    try:
        with RouterClient(url, timeout_s=timeout) as client:
            status = client.cluster_status()
    except grpc.RpcError as e:
        raise UserError(f"cannot reach the router at {url}: {e.code().name}: {e.details()}") from None
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
