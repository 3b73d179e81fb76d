"""pdserve scale: manual scaling and the planner's view of a running cluster (its admin endpoint).

    pdserve scale                         replicas (ready / starting / draining), desired, last decision
    pdserve scale --prefill 2 --decode 3  set the pools; with --autoscale this becomes the planner's
                                          baseline (it holds it for its cooldown instead of fighting it)
"""

from __future__ import annotations

import json
from typing import Optional

import typer

from engine.errors import UserError


def command(
    prefill: Optional[int] = typer.Option(None, min=0, help="Prefill workers wanted."),
    decode: Optional[int] = typer.Option(None, min=1, help="Decode (or agg) workers wanted."),
    admin_url: str = typer.Option("http://127.0.0.1:8100", help="The cluster's admin endpoint (pdserve serve --admin-port)."),
    as_json: bool = typer.Option(False, "--json", help="Print the JSON answer."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="The cluster's --api-key (default: $PDSERVE_API_KEY)."),
) -> None:
    """Show or set the number of prefill and decode workers of a running cluster."""
    import httpx

    from router.auth import resolve_api_key

    key = resolve_api_key(api_key)
    headers = {"Authorization": f"Bearer {key}"} if key else None
    try:
        with httpx.Client(timeout=30.0, headers=headers) as client:
            if prefill is None and decode is None:
                r = client.get(f"{admin_url}/v1/cluster")
            else:
                body = {k: v for k, v in (("prefill", prefill), ("decode", decode)) if v is not None}
                r = client.post(f"{admin_url}/v1/cluster/scale", json=body)
    except httpx.HTTPError as e:
        raise UserError(f"--admin-url {admin_url}: cannot reach the admin endpoint ({type(e).__name__})") from None
    doc = r.json()
    if r.status_code == 401:
        raise UserError(f"--admin-url {admin_url}: the cluster has an API key: pass --api-key or set $PDSERVE_API_KEY")
    if r.status_code != 200:
        raise UserError(doc.get("error", {}).get("message", f"HTTP {r.status_code}"))
    if as_json:
        print(json.dumps(doc, indent=2))
        return
    print(render(doc))


def render(doc: dict) -> str:
    lines = [f"{'role':<9}{'desired':>8}{'ready':>7}{'starting':>10}{'draining':>10}"]
    desired = doc.get("desired", {})
    for role, r in doc.get("replicas", {}).items():
        want = desired.get(role, desired.get("decode") if role == "agg" else None)
        lines.append(f"{role:<9}{'-' if want is None else want:>8}{r['ready']:>7}{r['starting']:>10}{r['draining']:>10}")
    if doc.get("actions"):
        lines.append(f"actions: {json.dumps(doc['actions'])}")
    last = doc.get("last_decision")
    if last:
        lines.append(f"last decision ({last['loop']}): {last['reason']}")
    elif "autoscale" in doc:
        lines.append("autoscaling: " + ("on, no decision yet" if doc["autoscale"] else "off"))
    return "\n".join(lines)
