"""deploy/kuberay/pdserve.yaml agrees with the CLI: every router flag exists on `pdserve serve`, the
worker groups carry the custom resources the role flags ask for and the GPUs the workers declare."""

from __future__ import annotations

import json
from pathlib import Path

import typer.main
import yaml

from deploy import cli, serve_cmd

MANIFEST = Path(__file__).resolve().parents[1] / "deploy" / "kuberay" / "pdserve.yaml"


def _docs() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text())}


def _router_flags() -> dict[str, str]:
    container = _docs()["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["pdserve", "serve"]
    flags = {}
    for arg in container["args"]:
        if arg.startswith("--"):
            name, _, value = arg.partition("=")
            flags[name] = value
    return flags


def _group_resources(group: dict) -> dict[str, float]:
    return json.loads(json.loads(group["rayStartParams"]["resources"]))


def test_every_router_flag_is_a_serve_flag():
    command = typer.main.get_command(cli.app).commands["serve"]
    known = {opt for p in command.params for opt in getattr(p, "opts", []) + getattr(p, "secondary_opts", [])
             if opt.startswith("--")}
    assert "--ray-address" in known  # the introspection works
    unknown = set(_router_flags()) - known
    assert not unknown, f"flags in the manifest that pdserve serve does not have: {unknown}"


def test_worker_groups_carry_the_resources_and_gpus_the_roles_ask_for():
    flags = _router_flags()
    groups = {g["groupName"]: g for g in _docs()["RayCluster"]["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for role in ("prefill", "decode"):
        wanted = dict(serve_cmd.parse_resources(flags[f"--{role}-resources"], f"--{role}-resources"))
        g = groups[role]
        offered = _group_resources(g)
        assert all(offered.get(k, 0) >= v for k, v in wanted.items()), (role, offered, wanted)
        other = "decode" if role == "prefill" else "prefill"
        assert other not in offered                     # a role's node never takes the other role
        gpus = float(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
        assert gpus >= float(flags["--num-gpus-per-worker"])
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        assert g["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert int(flags["--prefill"]) <= groups["prefill"]["maxReplicas"]
    assert int(flags["--decode"]) <= groups["decode"]["maxReplicas"]


def test_router_service_exposes_the_ports_the_router_serves():
    flags = _router_flags()
    ports = {p["name"]: p["targetPort"] for p in _docs()["Service"]["spec"]["ports"]}
    assert ports == {"grpc": int(flags["--port"]), "http": int(flags["--http-port"]),
                     "metrics": int(flags["--metrics-port"])}
    assert _docs()["Service"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
