"""Run by tests/test_multinode.py in a child process: a real Ray cluster of a head and two worker
nodes (`ray start`), each worker node labelled with a custom resource; the cluster controller
places the prefill and decode workers by those labels; prints JSON {worker id: labels of its node}."""

from __future__ import annotations

import asyncio
import json
import sys


async def main(address: str) -> None:
    import ray

    from deploy.cluster import ClusterController, ClusterSpec, init_ray

    init_ray(address)
    spec = ClusterSpec(num_prefill=1, num_decode=1, num_blocks=64, prefill_resources=(("prefill", 1.0),),
                       decode_resources=(("decode", 1.0),), worker_start_timeout_s=240)
    controller = ClusterController(spec)
    try:
        await controller.start()
        placement = await controller.placement()
        labels = {n["NodeID"]: sorted(k for k in n["Resources"] if k in ("prefill", "decode"))
                  for n in ray.nodes() if n["Alive"]}
        print(json.dumps({w: labels[node] for w, node in placement.items()}))
    finally:
        await controller.stop()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
