"""pdserve router: one more router replica on its own, discovering workers from a Redis registry.

    pdserve router --registry redis://127.0.0.1:6379/0 --port 50061 --http-port 8001 \
        --internal-secret-file SECRET --api-key KEY   # the secret file and key of the `pdserve serve` it joins

Also the routing options shared with `pdserve serve` (``routing_config``, ``check_registry``,
``check_api_key``), checked
before anything starts (a bad value is a one-line error naming the option, exit status 2).
Several routers share nothing but the registry and the workers' event streams: each sees the
load the others put on a worker through that worker's Stats (polled every 0.2 s), so its view of
the others' in-flight load is at most one poll interval stale; its own dispatches count at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from engine.errors import UserError

# Upper bound of every seconds option: a gRPC timeout past ~9.2e9 s (int64 nanoseconds) expires at once,
# so --request-timeout 1e12 (or inf) failed every request DEADLINE_EXCEEDED; a day matches the API's
# own `timeout` field (0 < timeout <= 86400).
MAX_SECONDS = 86400.0
POLICY_HELP = "Worker choice: kv (prefix overlap against load) | load | round-robin."
TEMPERATURE_HELP = "Softmax temperature of the kv cost (0: lowest cost, ties at random)."
WEIGHT_HELP = "w of the kv cost: one uncached prefill block counts as w decode blocks."
REGISTRY_HELP = "Worker registry, redis://HOST:PORT/DB (default: in-process, no Redis)."
SECRET_HELP = ("File holding the cluster's internal secret: every worker API call carries it, a process "
               "without it cannot Reserve, Prefill, Decode or Abort.")
TLS_HELP = "Certificate (PEM) to serve the public gRPC and HTTP APIs over TLS (needs --tls-key)."
INTERNAL_CA_HELP = "CA (PEM) the workers' --internal-tls-cert is verified against (default: that certificate)."
API_KEY_HELP = ("Clients must send 'Authorization: Bearer KEY' (HTTP) or metadata 'authorization: Bearer KEY' "
                "(gRPC); /health and /metrics stay open.")
MIGRATION_HELP = ("Times one request may move to another decode-capable worker when its worker dies or stalls "
                  "mid-stream (prompt + streamed tokens recomputed there, same client stream); 0: off.")


def routing_config(policy: str, temperature: float, overlap_weight: float = 2.0):
    """RoutingConfig from the CLI options; raises UserError naming the option."""
    from router.routing import RoutingConfig

    try:
        return RoutingConfig(policy=policy, temperature=temperature, overlap_weight=overlap_weight)
    except ValueError as e:
        raise UserError(str(e)) from None


def internal_secret(path, create: bool = False) -> str | None:
    """The cluster's internal secret: $PDSERVE_INTERNAL_SECRET, else the --internal-secret-file
    (serve creates it when missing), else None (serve: the controller makes one; router: an error
    later, when the workers refuse it). Raises UserError naming the option."""
    import os

    from proto.internal_auth import ENV_VAR, resolve_secret

    if os.environ.get(ENV_VAR):
        return os.environ[ENV_VAR]
    if path is None:
        return None
    if not create and not os.path.exists(path):
        raise UserError(f"--internal-secret-file: {str(path)!r} does not exist (pdserve serve creates it)")
    try:
        return resolve_secret(str(path))
    except (OSError, ValueError) as e:
        raise UserError(f"--internal-secret-file: cannot use {str(path)!r}: {getattr(e, 'strerror', None) or e}") \
            from None


def tls_files(cert, key, ca, prefix: str):
    """proto.tls.TlsFiles from the flags (None when not given); raises UserError naming the flag."""
    from proto.tls import TlsFiles

    try:
        return TlsFiles.from_flags(cert and str(cert), key and str(key), ca and str(ca), prefix)
    except ValueError as e:
        raise UserError(str(e)) from None


def check_api_key(flag: str | None) -> str | None:
    """--api-key (or $PDSERVE_API_KEY, which the option reads; click passes an empty one as unset):
    the key, None for none; UserError for a key that would protect nothing (router/auth.py)."""
    import os

    from router.auth import ENV_VAR, check_api_key as check

    if flag is None and os.environ.get(ENV_VAR) == "":
        flag, source = "", f"${ENV_VAR}"
    else:
        source = "--api-key"
    try:
        return None if flag is None else check(flag)
    except ValueError as e:
        raise UserError(f"{source}: {e}") from None


def check_registry(url: str) -> str | None:
    """The --registry URL checked, or None when not given; raises UserError naming the option."""
    if not url:
        return None
    from proto.registry import parse_url

    try:
        return parse_url(url)
    except ValueError as e:
        raise UserError(str(e)) from None


def command(
    registry: str = typer.Option(..., help=REGISTRY_HELP),
    mode: str = typer.Option("disagg", help="disagg | agg (as the cluster was started)"),
    host: str = typer.Option("127.0.0.1", help="Address the router binds to."),
    port: int = typer.Option(50061, min=0, max=65535, help="gRPC port."),
    http_port: int = typer.Option(8001, min=-1, max=65535, help="OpenAI-compatible HTTP port (-1: off)."),
    metrics_port: int = typer.Option(-1, min=-1, max=65535, help="Prometheus port (-1: off)."),
    api_key: Optional[str] = typer.Option(None, envvar="PDSERVE_API_KEY", show_envvar=True, show_default=False,
                                          help=API_KEY_HELP + " Give the same key as the serve it joins."),
    router_policy: str = typer.Option("kv", help=POLICY_HELP),
    router_temperature: float = typer.Option(0.0, help=TEMPERATURE_HELP),
    kv_overlap_score_weight: float = typer.Option(2.0, help=WEIGHT_HELP),
    local_prefill_threshold: int = typer.Option(0, help="Prompts whose uncached part is shorter than this are "
                                                        "prefilled on the decode worker."),
    max_waiting: int = typer.Option(256, help="More waiting requests than this: RESOURCE_EXHAUSTED."),
    drain_seconds: float = typer.Option(30.0, min=0.0, max=MAX_SECONDS,
                                        help="Grace period for in-flight requests at shutdown."),
    migration_limit: int = typer.Option(3, min=0, help=MIGRATION_HELP),
    internal_secret_file: Optional[Path] = typer.Option(None, help=SECRET_HELP + " Default: $PDSERVE_INTERNAL_SECRET."),
    tls_cert: Optional[Path] = typer.Option(None, help=TLS_HELP),
    tls_key: Optional[Path] = typer.Option(None, help="Private key (PEM) of --tls-cert."),
    internal_tls_ca: Optional[Path] = typer.Option(None, help="CA (PEM) to verify the workers' TLS certificate; "
                                                   "set when the cluster runs with --internal-tls-cert."),
) -> None:
    """pdserve router: one more router replica for a cluster that registers in Redis."""
    import asyncio

    from router.app import RouterConfig

    key = check_api_key(api_key)
    url = check_registry(registry)
    if url is None:
        raise UserError("--registry is required: pdserve router discovers workers from Redis")
    if mode not in ("disagg", "agg"):
        raise UserError(f"--mode must be disagg or agg, got {mode!r}")
    config = RouterConfig(host=host, port=port, http_port=None if http_port < 0 else http_port,
                          metrics_port=None if metrics_port < 0 else metrics_port, mode=mode,
                          local_prefill_threshold=local_prefill_threshold, max_waiting=max_waiting,
                          drain_grace_s=drain_seconds, migration_limit=migration_limit,
                          internal_secret=internal_secret(internal_secret_file),
                          tls=tls_files(tls_cert, tls_key, None, "--tls"),
                          internal_tls=None if internal_tls_ca is None else _ca_only(internal_tls_ca),
                          routing=routing_config(router_policy, router_temperature, kv_overlap_score_weight),
                          api_key=key)
    asyncio.run(_run(url, config))


async def _run(url: str, config) -> None:
    import asyncio
    import signal

    from router.app import Router
    from router.redis_registry import RedisRegistry

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    router = Router(RedisRegistry(url), config)
    try:
        ep = await router.start()
        print(f"pdserve router: grpc {ep.grpc}" + (f", http http://{ep.http}/v1" if ep.http else "")
              + f", registry {url} ({len(router.pool.workers())} workers)", flush=True)
        await stop.wait()
        print("pdserve router: draining...", flush=True)
    finally:
        await router.stop()
        print("pdserve router: stopped", flush=True)


def _ca_only(ca):
    """A router verifies the workers' certificate with the CA alone (it serves no worker API)."""
    from proto.tls import TlsFiles

    try:
        open(ca, "rb").close()
    except OSError as e:
        raise UserError(f"--internal-tls-ca: cannot read {str(ca)!r}: {e.strerror}") from None
    return TlsFiles(cert_file=str(ca), key_file="", ca_file=str(ca))
