"""The cluster's admin endpoint (127.0.0.1 by default): replicas, the planner's last decision, scaling.

    GET  /v1/cluster        {"replicas": {role: {ready, starting, draining}}, "desired": {...},
                             "autoscale": bool, "last_decision": {...} | null, "drained": [ids]}
    POST /v1/cluster/scale  {"prefill": N, "decode": M} (either may be omitted): manual sizes;
                            with --autoscale they become the planner's baseline (it does not fight them)
    GET  /metrics           pdserve:planner_desired_replicas{role}, pdserve:planner_replicas{role,state}

Bad input is a 400 naming the field. `pdserve scale` is its client. With the cluster's --api-key
every route but /metrics needs `Authorization: Bearer KEY`, as the public HTTP API does
(router/auth.py): this endpoint starts and drains workers.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse


def build_admin_app(controller, autoscaler=None, api_key: str | None = None):
    """api_key: when set, every route but /metrics answers 401 without `Authorization: Bearer KEY`."""
    app = FastAPI(title="pdserve admin")
    if api_key is not None:
        from router.auth import ApiKeyMiddleware

        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    manual: dict[str, int] = {}

    def desired() -> dict[str, int]:
        if autoscaler is not None:
            return autoscaler.desired
        reps = controller.replicas()
        out = {role: v["ready"] + v["starting"] for role, v in reps.items()}
        return out | manual

    @app.get("/v1/cluster")
    async def status() -> dict[str, Any]:
        return {"replicas": controller.replicas(), "desired": desired(), "autoscale": autoscaler is not None,
                "last_decision": autoscaler.history[-1] if autoscaler and autoscaler.history else None,
                "drained": list(controller.drained)}

    @app.post("/v1/cluster/scale")
    async def scale(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return _error("body", "must be a JSON object like {\"prefill\": 2, \"decode\": 3}")
        if not isinstance(body, dict):
            return _error("body", "must be a JSON object like {\"prefill\": 2, \"decode\": 3}")
        unknown = set(body) - {"prefill", "decode"}
        if unknown:
            return _error(sorted(unknown)[0], "unknown field: give prefill and/or decode")
        roles = controller.replicas()
        for name, least in (("prefill", 0), ("decode", 1)):
            v = body.get(name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < least or v > 4096):
                return _error(name, f"must be an integer in [{least}, 4096]")
        if "agg" in roles and body.get("prefill"):
            return _error("prefill", "an agg cluster has no prefill workers")
        if autoscaler is not None:
            entry = await autoscaler.adopt_manual(body.get("prefill"), body.get("decode"))
            return {"actions": entry["actions"], "replicas": controller.replicas()}
        actions = {}
        for name in ("prefill", "decode"):
            if body.get(name) is not None:
                role = "agg" if name == "decode" and "agg" in roles else name
                actions[role] = await controller.scale(role, body[name])
                manual[role] = body[name]
        return {"actions": actions, "replicas": controller.replicas()}

    @app.get("/metrics")
    async def metrics():
        lines = ["# TYPE pdserve:planner_desired_replicas gauge"]
        lines += [f'pdserve:planner_desired_replicas{{role="{r}"}} {n}' for r, n in desired().items()]
        lines.append("# TYPE pdserve:planner_replicas gauge")
        for role, states in controller.replicas().items():
            lines += [f'pdserve:planner_replicas{{role="{role}",state="{k}"}} {v}' for k, v in states.items()]
        return PlainTextResponse("\n".join(lines) + "\n")

    def _error(field: str, message: str):
        return JSONResponse({"error": {"message": f"{field}: {message}", "type": "invalid_request_error",
                                       "param": field, "code": 400}}, status_code=400)

    return app


async def serve_admin(app, host: str, port: int):
    """Start uvicorn for the admin app in this event loop; returns (server, its task)."""
    import asyncio

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.05)
    return server, task
