"""Building and starting one worker process of any role (used by the Ray worker actor).

The role is chosen here, above the role packages, so that worker/ (shared) never imports
prefill_worker/ or decode_worker/, and those two never import each other.
"""

from __future__ import annotations

import asyncio

from worker.core import WorkerConfig, WorkerCore
from worker.server import WorkerServer, create_kv_transport, load_engine, serve


def build_worker(config: WorkerConfig) -> WorkerCore:
    """Load the engine and the transport for config.role and build that role (heavy: imports torch)."""
    engine, model_dir, runner = load_engine(config)
    args = (config, engine, model_dir, runner.model_config)
    if config.role == "agg":
        from worker.agg import AggWorker

        return AggWorker(*args)
    transport, metadata = create_kv_transport(config, runner)
    if config.role == "decode":
        from decode_worker.worker import DecodeWorker

        worker = DecodeWorker(*args, transport=transport)
    else:
        from prefill_worker.kv_push import KVPusher
        from prefill_worker.worker import PrefillWorker

        spec = runner.kv_cache.spec
        pusher = KVPusher(transport, spec.block_size, spec.num_layers, 2 * spec.block_bytes, config.transfer_timeout_s)
        worker = PrefillWorker(*args, transport=transport, pusher=pusher)
    worker.kv_metadata = metadata
    return worker


async def start_worker(config: WorkerConfig) -> WorkerServer:
    """Build the worker (in a thread: loading is slow) and serve it on config.host:config.port."""
    worker = await asyncio.to_thread(build_worker, config)
    return await serve(worker, config.host, config.port, config.internal_secret, tls=config.tls)
