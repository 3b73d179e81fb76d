"""pdserve serve: start the router and the prefill/decode workers on Ray.

Starts an embedded local Ray (or joins --ray-address), boots the workers as Ray actors, runs the
router (gRPC + OpenAI HTTP + metrics) in this process, prints the endpoints, and on Ctrl-C
(SIGINT) or SIGTERM drains in-flight requests and shuts everything down. Run it inside a
loopback-only network namespace on machines like the development boxes (see MACHINE-NOTES).
"""

from __future__ import annotations

import typer

from engine.errors import UserError


def command(
    model: str = typer.Option("smollm2-135m-instruct", help="Model name or HF directory / .gguf path."),
    prefill: int = typer.Option(1, "--prefill", min=0, help="Prefill workers (disagg mode)."),
    decode: int = typer.Option(1, "--decode", min=1, help="Decode workers (agg workers in agg mode)."),
    mode: str = typer.Option("disagg", help="disagg | agg"),
    kv_transport: str = typer.Option("tcp", help="nixl | torch | tcp"),
    host: str = typer.Option("127.0.0.1", help="Address every server binds to."),
    port: int = typer.Option(50051, help="gRPC port of the router."),
    http_port: int = typer.Option(8000, help="OpenAI-compatible HTTP port (-1: off)."),
    metrics_port: int = typer.Option(9400, help="Prometheus port of the router; workers use the next ones (-1: off)."),
    ray_address: str = typer.Option("", help="Existing Ray cluster address; default: start a local one."),
    local_prefill_threshold: int = typer.Option(0, help="Prompts shorter than this many tokens are prefilled "
                                                        "on the decode worker."),
    max_waiting: int = typer.Option(256, help="More waiting requests than this: RESOURCE_EXHAUSTED."),
    num_blocks: int = typer.Option(512, help="KV blocks per worker."),
    max_num_seqs: int = typer.Option(32, help="Most requests in a worker's running batch."),
    num_gpus_per_worker: float = typer.Option(0.0, help="GPUs declared per worker (1 on GPU nodes)."),
    drain_seconds: float = typer.Option(30.0, help="Grace period for in-flight requests at shutdown."),
) -> None:
    """pdserve serve: start the router and workers on Ray."""
    import asyncio

    from deploy.cluster import ClusterSpec

    if mode not in ("disagg", "agg"):
        raise UserError(f"--mode must be disagg or agg, got {mode!r}")
    if kv_transport not in ("nixl", "torch", "tcp"):
        raise UserError(f"--kv-transport must be nixl, torch or tcp, got {kv_transport!r}")
    if mode == "disagg" and prefill < 1:
        raise UserError("--prefill must be >= 1 in disagg mode")
    spec = ClusterSpec(model=model, num_prefill=prefill if mode == "disagg" else 0, num_decode=decode, mode=mode,
                       kv_transport=kv_transport, num_blocks=num_blocks, max_num_seqs=max_num_seqs, host=host,
                       metrics_port=None if metrics_port < 0 else metrics_port,
                       num_gpus_per_worker=num_gpus_per_worker)
    asyncio.run(_serve(spec, port, None if http_port < 0 else http_port, ray_address or None,
                       local_prefill_threshold, max_waiting, drain_seconds))


async def _serve(spec, port: int, http_port: int | None, ray_address: str | None, threshold: int,
                 max_waiting: int, drain_s: float) -> None:
    import asyncio
    import signal

    from deploy.cluster import ClusterController, init_ray
    from router.app import Router, RouterConfig
    from router.registry import CallableRegistry

    n_workers = len(spec.worker_configs())
    init_ray(ray_address, num_cpus=None if ray_address else max(n_workers, 2))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    controller = ClusterController(spec)
    router = None
    try:
        print(f"pdserve: starting {n_workers} workers ({spec.mode}, kv transport {spec.kv_transport})...", flush=True)
        await _until_stopped(controller.start(), stop)
        router = Router(CallableRegistry(controller.list_workers), RouterConfig(
            host=spec.host, port=port, http_port=http_port, metrics_port=spec.metrics_port, mode=spec.mode,
            local_prefill_threshold=threshold, max_waiting=max_waiting, drain_grace_s=drain_s))
        ep = await router.start()
        lines = [f"pdserve: serving {spec.model}", f"  grpc     {ep.grpc}"]
        lines += [f"  http     http://{ep.http}/v1"] if ep.http else []
        lines += [f"  metrics  http://{ep.metrics}/metrics"] if ep.metrics else []
        print("\n".join(lines), flush=True)
        for w in await controller.list_workers():
            print(f"  worker   {w.id:<10} {w.role:<8} {w.address}", flush=True)
        print("pdserve: ready (Ctrl-C drains and stops)", flush=True)
        await stop.wait()
        print("pdserve: draining...", flush=True)
    finally:
        if router is not None:
            await router.stop()
        await controller.stop()
        import ray

        ray.shutdown()
        print("pdserve: stopped", flush=True)


async def _until_stopped(coro, stop) -> None:
    """Run coro unless stop is set first (Ctrl-C while the workers load)."""
    import asyncio

    task = asyncio.ensure_future(coro)
    waiter = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task not in done:
        task.cancel()
        raise KeyboardInterrupt
    task.result()
