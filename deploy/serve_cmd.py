"""pdserve serve: start the router and the prefill/decode workers on Ray.

Starts an embedded local Ray (or joins --ray-address), boots the workers as Ray actors, runs the
router (gRPC + OpenAI HTTP + metrics) in this process, prints the endpoints, and on Ctrl-C
(SIGINT) or SIGTERM drains in-flight requests and shuts everything down. Run it inside a
loopback-only network namespace on machines like the development boxes (see MACHINE-NOTES).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from deploy import router_cmd, runtime_options
from engine.errors import UserError
from engine.quantization import check_kv_cache_dtype, check_quantization

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_SLO = "ttft:2000,itl:200"
DEFAULT_PLANNER_INTERVAL_S = 60.0

# `pdserve serve --help` groups (typer rich_help_panel), by concern
MODEL, CLUSTER, SCHED, NET, ROUTER, LEASES = ("Model", "Cluster", "Scheduler and KV cache", "Network",
                                              "Router", "Timeouts, leases and retries")
SPEC = "Speculative decoding"
SCALE = "Autoscaling"


def command(
    model_arg: Optional[str] = typer.Argument(None, metavar="MODEL", show_default=False,
                                              help=f"Model name or HF directory / .gguf path (default: {DEFAULT_MODEL})."),
    model: Optional[str] = typer.Option(None, "--model", help="Same as MODEL (kept for scripts).",
                                        rich_help_panel=MODEL, show_default=False),
    served_model_name: Optional[str] = typer.Option(None, help="Model id clients send and see (default: MODEL).",
                                                    rich_help_panel=MODEL, show_default=False),
    max_model_len: Optional[int] = typer.Option(None, min=2, help="Longest sequence (prompt + output) in tokens "
                                                "(default: the model's context).", rich_help_panel=MODEL),
    chat_template: Optional[Path] = typer.Option(None, help="Jinja chat template file replacing the model's.",
                                                 rich_help_panel=MODEL, show_default=False),
    generation_config: str = typer.Option("auto", help="Default sampling values: auto (the model's "
                                          "generation_config.json), vllm (none) or a directory.",
                                          rich_help_panel=MODEL),
    prefill: int = typer.Option(1, "--prefill", min=0, help="Prefill workers (disagg mode).", rich_help_panel=CLUSTER),
    decode: int = typer.Option(1, "--decode", min=1, help="Decode workers (agg workers in agg mode).",
                               rich_help_panel=CLUSTER),
    mode: str = typer.Option("agg", help="agg | disagg. agg (default): one engine per worker does prefill and "
                             "decode (measured faster than disagg 1P+1D and than two agg workers on a 2-core "
                             "CPU host: `pdserve bench peers`); disagg: --prefill P workers hand KV to --decode D workers.",
                             rich_help_panel=CLUSTER),
    kv_transport: str = typer.Option("tcp", help="nixl | torch | tcp", rich_help_panel=CLUSTER),
    kv_checksum: bool = typer.Option(False, "--kv-checksum", help="Debug: digest each request's KV on the prefill "
                                     "and decode worker and refuse to decode a mismatch.", rich_help_panel=CLUSTER),
    kv_fault_injection: str = typer.Option("", help="Debug: inject KV-transport faults, e.g. "
                                           "'drop_notify=0.1,delay_notify_s=0.02,corrupt=0.01,match=req-' "
                                           "(kv_transfer/faults.py).", rich_help_panel=CLUSTER),
    ray_address: str = typer.Option("", help="Existing Ray cluster address; default: start a local one.",
                                    rich_help_panel=CLUSTER),
    num_gpus_per_worker: float = typer.Option(0.0, min=0.0, help="GPUs declared per worker (1 on GPU nodes).",
                                              rich_help_panel=CLUSTER),
    prefill_resources: str = typer.Option("", help='Ray custom resources each prefill worker needs, JSON, e.g. '
                                          '\'{"prefill": 1}\' (places the role on the nodes that carry them).',
                                          rich_help_panel=CLUSTER),
    decode_resources: str = typer.Option("", help="Ray custom resources each decode (or agg) worker needs, JSON.",
                                         rich_help_panel=CLUSTER),
    num_cpus_per_worker: float = typer.Option(1.0, min=0.0, help="CPUs Ray reserves per worker.",
                                              rich_help_panel=CLUSTER),
    block_size: int = typer.Option(16, min=1, help="Tokens per KV block.", rich_help_panel=SCHED),
    max_num_seqs: int = typer.Option(32, min=1, help="Most requests in a worker's running batch.",
                                     rich_help_panel=SCHED),
    enable_prefix_caching: bool = typer.Option(True, "--enable-prefix-caching/--no-enable-prefix-caching",
                                               help="Reuse the KV blocks of a shared prompt prefix.",
                                               rich_help_panel=SCHED),
    batching: str = typer.Option("continuous", help="continuous (iteration-level, Orca/vLLM) | static (HF generate "
                                 "style: lockstep batches padded to the longest prompt, KV reserved for the whole "
                                 "rectangle; for comparison, e.g. `pdserve bench ablate`'s baseline; agg mode, no "
                                 "speculative decoding).", rich_help_panel=SCHED),
    host: str = typer.Option("127.0.0.1", help="Address every server binds to.", rich_help_panel=NET),
    port: int = typer.Option(50051, min=0, max=65535, help="gRPC port of the router.", rich_help_panel=NET),
    http_port: int = typer.Option(8000, min=-1, max=65535, help="OpenAI-compatible HTTP port (-1: off).",
                                  rich_help_panel=NET),
    metrics_port: int = typer.Option(9400, min=-1, max=65535,
                                     help="Prometheus port of the router; workers use the next ones (-1: off).",
                                     rich_help_panel=NET),
    local_prefill_threshold: int = typer.Option(0, min=0, help="Prompts shorter than this many tokens are "
                                                "prefilled on the decode worker.", rich_help_panel=ROUTER),
    api_key: Optional[str] = typer.Option(None, envvar="PDSERVE_API_KEY", show_envvar=True, show_default=False,
                                          help=router_cmd.API_KEY_HELP, rich_help_panel=ROUTER),
    max_body_bytes: int = typer.Option(16 * 1024 * 1024, min=1, help="A larger HTTP request body is answered 413.",
                                       rich_help_panel=ROUTER),
    tls_cert: Optional[Path] = typer.Option(None, help=router_cmd.TLS_HELP, rich_help_panel=NET),
    tls_key: Optional[Path] = typer.Option(None, help="Private key (PEM) of --tls-cert.", rich_help_panel=NET),
    internal_tls_cert: Optional[Path] = typer.Option(None, help="Certificate (PEM) every worker serves its API "
                                                     "with; routers verify it (needs --internal-tls-key).",
                                                     rich_help_panel=NET),
    internal_tls_key: Optional[Path] = typer.Option(None, help="Private key (PEM) of --internal-tls-cert.",
                                                    rich_help_panel=NET),
    internal_tls_ca: Optional[Path] = typer.Option(None, help=router_cmd.INTERNAL_CA_HELP, rich_help_panel=NET),
    internal_secret_file: Optional[Path] = typer.Option(None, help=router_cmd.SECRET_HELP + " Created with a random "
                                                        "secret if missing; default: $PDSERVE_INTERNAL_SECRET, else a "
                                                        "new random one.", rich_help_panel=CLUSTER),
    max_waiting: int = typer.Option(256, min=0, help="More waiting requests than this: RESOURCE_EXHAUSTED (429).",
                                    rich_help_panel=ROUTER),
    worker_poll_interval: float = typer.Option(0.2, min=0.01, max=router_cmd.MAX_SECONDS, help="Seconds between the router's polls of the "
                                               "registry and of each worker's load.", rich_help_panel=ROUTER),
    request_timeout: float = typer.Option(600.0, min=0.001, max=router_cmd.MAX_SECONDS, help="Deadline in seconds of a request that sets none.",
                                          rich_help_panel=LEASES),
    reservation_lease: float = typer.Option(120.0, min=0.001, max=router_cmd.MAX_SECONDS, help="Seconds a decode worker keeps blocks reserved "
                                            "for KV whose Decode never comes.", rich_help_panel=LEASES),
    hold_lease: float = typer.Option(30.0, min=0.001, max=router_cmd.MAX_SECONDS, help="Seconds a prefill worker holds sent KV blocks "
                                     "without a Release.", rich_help_panel=LEASES),
    transfer_timeout: float = typer.Option(30.0, min=0.001, max=router_cmd.MAX_SECONDS, help="Seconds for a prefill worker's KV push to be "
                                           "confirmed.", rich_help_panel=LEASES),
    prefill_attempts: int = typer.Option(2, min=1, help="Prefill workers tried per request (all before the "
                                         "first token).", rich_help_panel=LEASES),
    abort_timeout: float = typer.Option(30.0, min=0.001, max=router_cmd.MAX_SECONDS, help="Seconds per Abort / Release call to a worker.",
                                        rich_help_panel=LEASES),
    migration_limit: int = typer.Option(3, min=0, help=router_cmd.MIGRATION_HELP, rich_help_panel=LEASES),
    worker_rpc_timeout: float = typer.Option(2.0, min=0.001, max=router_cmd.MAX_SECONDS, help="Seconds per Info / Stats call to a worker; "
                                             "a worker that misses it is suspect (no new requests) until it answers again.", rich_help_panel=LEASES),
    worker_start_timeout: float = typer.Option(300.0, min=1.0, max=router_cmd.MAX_SECONDS, help="Seconds for every worker to load and serve.",
                                               rich_help_panel=LEASES),
    drain_seconds: float = typer.Option(30.0, min=0.0, max=router_cmd.MAX_SECONDS, help="Grace period for in-flight requests at shutdown.",
                                        rich_help_panel=LEASES),
    registry: str = typer.Option("", help=router_cmd.REGISTRY_HELP, rich_help_panel=CLUSTER),
    router_policy: str = typer.Option("kv", help=router_cmd.POLICY_HELP, rich_help_panel=ROUTER),
    router_temperature: float = typer.Option(0.0, help=router_cmd.TEMPERATURE_HELP, rich_help_panel=ROUTER),
    kv_overlap_score_weight: float = typer.Option(2.0, help=router_cmd.WEIGHT_HELP, rich_help_panel=ROUTER),
    routers: int = typer.Option(1, min=1, help="Router replicas (gRPC ports --port, --port+1, ...; HTTP likewise; "
                                "metrics on the first).", rich_help_panel=ROUTER),
    dtype: str = runtime_options.dtype_option(),
    quantization: str = typer.Option("none", help="Linear method of every worker: none, int8 or fp8."),
    kv_cache_dtype: str = typer.Option("auto", help="KV-cache dtype of every worker: auto or fp8_e4m3."),
    threads_per_worker: Optional[int] = runtime_options.threads_option(),
    kv_cache_memory: Optional[str] = runtime_options.kv_memory_option(),
    num_blocks: Optional[int] = runtime_options.num_blocks_option(),
    max_num_batched_tokens: int = runtime_options.batched_tokens_option(),
    idle_max_num_batched_tokens: int = runtime_options.idle_batched_tokens_option(),
    prefill_max_num_batched_tokens: int = runtime_options.prefill_batched_tokens_option(),
    prefill_first_ratio: float = runtime_options.prefill_first_ratio_option(),
    speculative_method: Optional[str] = typer.Option(None, help="ngram (prompt lookup) | draft; default: off.",
                                                     rich_help_panel=SPEC),
    num_speculative_tokens: Optional[int] = typer.Option(None, help="Most draft tokens per request and step "
                                                         "(default 4); each step's k is chosen in 0..K by load.",
                                                         rich_help_panel=SPEC),
    speculative_model: Optional[str] = typer.Option(None, help="Draft model with the target's tokenizer (method "
                                                    "draft), e.g. the served model itself, quantized.",
                                                    rich_help_panel=SPEC),
    speculative_quantization: str = typer.Option("none", help="Linear method of the draft: none | int8 | fp8.",
                                                 rich_help_panel=SPEC),
    speculative_draft_vocab_size: Optional[int] = typer.Option(
        None, help="The draft's LM head covers token ids < N only (FR-Spec; the tokenizer's ids are in BPE merge, "
                   "i.e. frequency, order); output stays exactly the target's. Default: the whole vocabulary.",
        rich_help_panel=SPEC, show_default=False),
    spec_ngram_max: Optional[int] = typer.Option(None, help="Longest n-gram matched (method ngram; default 4).",
                                                 rich_help_panel=SPEC),
    spec_ngram_min: Optional[int] = typer.Option(None, help="Shortest n-gram matched (method ngram; default 2).",
                                                 rich_help_panel=SPEC),
    autoscale: bool = typer.Option(False, help="Run the SLA planner: scale prefill and decode pools to the --slo.",
                                   rich_help_panel=SCALE),
    slo: Optional[str] = typer.Option(None, help=f"Planner SLOs in ms: ttft:MS,itl:MS (with --autoscale; default "
                                      f"{DEFAULT_SLO}).", rich_help_panel=SCALE, show_default=False),
    profile: Optional[Path] = typer.Option(None, help="Worker profile JSON from `pdserve profile` (needed by "
                                                      "--autoscale).", rich_help_panel=SCALE),
    planner_interval: Optional[float] = typer.Option(None, min=1.0, max=router_cmd.MAX_SECONDS, help="Seconds between SLA planner decisions "
                                                     f"(with --autoscale; default {DEFAULT_PLANNER_INTERVAL_S:g}).",
                                                     rich_help_panel=SCALE, show_default=False),
    min_prefill: int = typer.Option(1, min=0, help="Fewest prefill workers the planner keeps.", rich_help_panel=SCALE),
    max_prefill: int = typer.Option(4, min=0, help="Most prefill workers the planner starts.", rich_help_panel=SCALE),
    min_decode: int = typer.Option(1, min=1, help="Fewest decode workers the planner keeps.", rich_help_panel=SCALE),
    max_decode: int = typer.Option(4, min=1, help="Most decode workers the planner starts.", rich_help_panel=SCALE),
    admin_port: int = typer.Option(8100, min=-1, max=65535, help="Admin HTTP port (replicas, planner decision, `pdserve scale`; "
                                              "-1: off). Binds --host.", rich_help_panel=SCALE),
) -> None:
    """pdserve serve [MODEL]: start the router and workers on Ray."""
    import asyncio

    from deploy.cluster import ClusterSpec
    from engine.spec_decode.config import from_flags
    from router.app import RouterConfig

    model = _model(model_arg, model)
    check_planner_flags(autoscale, slo=slo, profile=profile, planner_interval=planner_interval)
    api_key = router_cmd.check_api_key(api_key)
    check_quantization(quantization)
    check_kv_cache_dtype(kv_cache_dtype)
    registry_url = router_cmd.check_registry(registry)
    routing = router_cmd.routing_config(router_policy, router_temperature, kv_overlap_score_weight)
    speculative = from_flags(speculative_method, num_speculative_tokens, speculative_model, spec_ngram_max,
                             spec_ngram_min, speculative_quantization, speculative_draft_vocab_size)
    if mode not in ("disagg", "agg"):
        raise UserError(f"--mode must be disagg or agg, got {mode!r}")
    check_batching(batching, mode, speculative)
    if kv_transport not in ("nixl", "torch", "tcp"):
        raise UserError(f"--kv-transport must be nixl, torch or tcp, got {kv_transport!r}")
    if kv_fault_injection:  # imported only when asked for: kv_transfer pulls in torch
        from kv_transfer.faults import FaultSpec

        try:
            FaultSpec.parse(kv_fault_injection)
        except ValueError as e:
            raise UserError(f"--kv-fault-injection: {e}") from None
    if mode == "disagg" and prefill < 1:
        raise UserError("--prefill must be >= 1 in disagg mode")
    _check_readable(chat_template, "--chat-template")
    # One secret for the workers and every router of this serve, made here when none was given
    # (a router without it is refused by every worker: "no live worker").
    from proto.internal_auth import new_secret

    internal_secret = router_cmd.internal_secret(internal_secret_file, create=True) or new_secret()
    tls = router_cmd.tls_files(tls_cert, tls_key, None, "--tls")
    internal_tls = router_cmd.tls_files(internal_tls_cert, internal_tls_key, internal_tls_ca, "--internal-tls")
    if generation_config not in ("auto", "vllm"):
        _check_readable(Path(generation_config) / "generation_config.json", "--generation-config")
    num_prefill = prefill if mode == "disagg" else 0
    # Checked here, before Ray or any worker starts; "auto" is resolved once so every worker agrees.
    model_dir = runtime_options.check_model(model, local_cluster=not ray_address, max_model_len=max_model_len)
    if speculative is not None and speculative.model:
        try:
            draft_dir = runtime_options.check_model(speculative.model, local_cluster=not ray_address)
        except UserError as e:
            raise UserError(f"--speculative-model: {e}") from None
        runtime_options.check_draft_vocab_size(draft_dir, speculative.draft_vocab_size)
    rt = runtime_options.resolve_runtime(
        model_dir=model_dir, dtype=dtype, threads_per_worker=threads_per_worker,
        kv_cache_memory=kv_cache_memory, num_blocks=num_blocks, max_num_batched_tokens=max_num_batched_tokens,
        num_workers=num_prefill + decode, device="cuda" if num_gpus_per_worker > 0 else "cpu",
        block_size=block_size, max_num_seqs=max_num_seqs, bind_cores=not ray_address)
    spec = ClusterSpec(model=model, num_prefill=num_prefill, num_decode=decode, mode=mode,
                       dtype=rt.dtype, threads_per_worker=rt.threads, cpu_cores=rt.cores,
                       quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                       kv_cache_memory_bytes=rt.kv_cache_memory_bytes, max_num_batched_tokens=rt.max_num_batched_tokens,
                       prefill_kv_cache_memory_bytes=runtime_options.default_prefill_kv_cache_bytes(
                           rt, kv_cache_memory, num_blocks),
                       idle_max_num_batched_tokens=runtime_options.check_idle_batched_tokens(idle_max_num_batched_tokens),
                       prefill_max_num_batched_tokens=runtime_options.check_prefill_batched_tokens(
                           prefill_max_num_batched_tokens, max_num_seqs),
                       prefill_first_ratio=runtime_options.check_prefill_first_ratio(prefill_first_ratio),
                       kv_transport=kv_transport, num_blocks=rt.num_blocks, max_num_seqs=max_num_seqs, host=host,
                       metrics_port=None if metrics_port < 0 else metrics_port,
                       num_gpus_per_worker=num_gpus_per_worker, num_cpus_per_worker=num_cpus_per_worker,
                       block_size=block_size, max_model_len=max_model_len,
                       enable_prefix_caching=enable_prefix_caching, batching=batching,
                       served_model_name=served_model_name,
                       transfer_timeout_s=transfer_timeout, worker_start_timeout_s=worker_start_timeout,
                       prefill_resources=parse_resources(prefill_resources, "--prefill-resources"),
                       decode_resources=parse_resources(decode_resources, "--decode-resources"),
                       registry_url=registry_url, speculative=speculative, internal_secret=internal_secret,
                       internal_tls=internal_tls, kv_checksum=kv_checksum, kv_faults=kv_fault_injection)
    router = RouterConfig(host=host, port=port, http_port=None if http_port < 0 else http_port,
                          metrics_port=spec.metrics_port, mode=mode, local_prefill_threshold=local_prefill_threshold,
                          max_waiting=max_waiting, drain_grace_s=drain_seconds, served_model_name=served_model_name,
                          chat_template=None if chat_template is None else str(chat_template),
                          generation_config=generation_config, request_timeout_s=request_timeout,
                          reservation_lease_s=reservation_lease, hold_lease_s=hold_lease,
                          prefill_attempts=prefill_attempts, abort_timeout_s=abort_timeout,
                          migration_limit=migration_limit,
                          worker_poll_interval_s=worker_poll_interval, worker_rpc_timeout_s=worker_rpc_timeout,
                          routing=routing, api_key=api_key, max_body_bytes=max_body_bytes,
                          internal_secret=internal_secret, tls=tls, internal_tls=internal_tls)
    print(f"pdserve: {rt.describe(spec.prefill_kv_cache_memory_bytes if num_prefill else None)}", flush=True)
    scaling = scaling_options(autoscale, slo, profile, planner_interval, min_prefill, max_prefill, min_decode,
                              max_decode, admin_port, mode, metrics_port)
    asyncio.run(_serve(spec, router, ray_address or None, routers, scaling))


def _model(positional: str | None, option: str | None) -> str:
    """MODEL and --model name the same thing; giving two different ones is a usage error."""
    if positional and option and positional != option:
        raise UserError(f"MODEL {positional!r} and --model {option!r} differ; give one")
    return positional or option or DEFAULT_MODEL


def check_planner_flags(autoscale: bool, **given) -> None:
    """The SLA planner's own flags (slo, profile, planner_interval: None when not given) do nothing
    without --autoscale, so giving one alone is a usage error naming both flags. Not made to imply
    --autoscale: the planner also needs --profile, and it would start adding and draining workers
    for a user who only wrote down a target (vLLM has no such flag; Dynamo's planner is a component
    one starts on purpose)."""
    if autoscale:
        return
    for name, value in given.items():
        if value is not None:
            flag = "--" + name.replace("_", "-")
            raise UserError(f"{flag} is for the SLA planner: add --autoscale (with --profile), or drop {flag}")


def check_batching(batching: str, mode: str, speculative) -> None:
    """--batching: continuous | static; static batching is an agg-mode, non-speculative policy
    (engine/static_batching.py admits from the waiting queue only, never remote KV)."""
    if batching not in ("continuous", "static"):
        raise UserError(f"--batching must be continuous or static, got {batching!r}")
    if batching == "static" and mode != "agg":
        raise UserError("--batching static: only with --mode agg (a decode worker admits remote KV continuously)")
    if batching == "static" and speculative is not None:
        raise UserError("--batching static: speculative decoding needs continuous batching (drop --speculative-method)")


def _check_readable(path: Path | None, flag: str) -> None:
    if path is None:
        return
    try:
        path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{flag}: cannot read {str(path)!r}: {getattr(e, 'strerror', None) or e}") from None


def replica_config(config, i: int):
    """Router replica i of --routers: the next ports (0 stays 0 = any free one), metrics on the first only."""
    from dataclasses import replace

    if i == 0:
        return config
    return replace(config, port=config.port + i if config.port else 0,
                   http_port=config.http_port + i if config.http_port else config.http_port, metrics_port=None)


@dataclass(frozen=True)
class ScalingOptions:
    """The planner's settings (None = no autoscaling) and the admin port (None = off)."""

    planner: "object | None"
    profile: "object | None"
    admin_port: int | None
    max_workers: int


def scaling_options(autoscale, slo, profile, interval, min_p, max_p, min_d, max_d, admin_port, mode,
                    metrics_port) -> ScalingOptions:
    """Validate the autoscaling flags (UserError naming the flag) before anything starts."""
    from deploy.plan_cmd import load_profile, parse_slo
    from planner.sla import PlannerConfig

    if min_p > max_p or min_d > max_d:
        raise UserError("--min-prefill/--max-prefill and --min-decode/--max-decode: each min must be <= its max")
    max_workers = max_d if mode == "agg" else max_p + max_d
    if not autoscale:
        return ScalingOptions(None, None, None if admin_port < 0 else admin_port, max_workers)
    if profile is None:
        raise UserError("--autoscale needs --profile (a worker profile from `pdserve profile`)")
    if metrics_port < 0:
        raise UserError("--autoscale reads the router's metrics: --metrics-port must not be -1")
    if admin_port < 0:
        raise UserError("--autoscale serves its decisions on the admin port: --admin-port must not be -1")
    ttft, itl = parse_slo(slo or DEFAULT_SLO)
    cfg = PlannerConfig(ttft_slo_ms=ttft, itl_slo_ms=itl, interval_s=interval or DEFAULT_PLANNER_INTERVAL_S, min_prefill=0 if mode == "agg" else min_p,
                        max_prefill=0 if mode == "agg" else max_p, min_decode=min_d, max_decode=max_d)
    return ScalingOptions(cfg, load_profile(str(profile)), admin_port, max_workers)


async def _serve(spec, router_config, ray_address: str | None, n_routers: int = 1,
                 scaling: ScalingOptions | None = None) -> None:
    import asyncio
    import signal

    from deploy.cluster import ClusterController, init_ray
    from router.app import Router
    from router.redis_registry import RedisRegistry
    from router.registry import CallableRegistry

    scaling = scaling or ScalingOptions(None, None, None, 0)
    init_ray(ray_address, num_cpus=None if ray_address else spec.ray_num_cpus(scaling.max_workers))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    controller = ClusterController(spec)
    routers: list[Router] = []
    autoscaler = admin = None
    try:
        n = len(spec.worker_configs())
        print(f"pdserve: starting {n} worker{'s' if n != 1 else ''} ({spec.mode}, kv transport {spec.kv_transport})...",
              flush=True)
        await _until_stopped(controller.start(), stop)
        lines = [f"pdserve: serving {spec.model}" + (f" as {spec.served_model_name}" if spec.served_model_name
                                                      else "")
                 + (f" (registry {spec.registry_url})" if spec.registry_url else "")]
        for i in range(n_routers):
            registry = RedisRegistry(spec.registry_url) if spec.registry_url else \
                CallableRegistry(controller.list_workers)
            routers.append(Router(registry, replica_config(router_config, i)))
            ep = await routers[-1].start()
            lines += [f"  grpc     {ep.grpc}"]
            lines += [f"  http     http://{ep.http}/v1"] if ep.http else []
            lines += [f"  metrics  http://{ep.metrics}/metrics"] if ep.metrics else []
        print("\n".join(lines), flush=True)
        autoscaler, admin = await _start_scaling(controller, scaling, spec.host, routers[0].endpoints.metrics,
                                                 router_config.api_key)
        if admin is not None:
            print(f"  admin    http://{spec.host}:{scaling.admin_port}/v1/cluster"
                  + (" (autoscaling)" if autoscaler else ""), flush=True)
        for w in await controller.list_workers():
            print(f"  worker   {w.id:<10} {w.role:<8} {w.address}", flush=True)
        print("pdserve: ready (Ctrl-C drains and stops)", flush=True)
        await stop.wait()
        print("pdserve: draining...", flush=True)
    finally:
        if autoscaler is not None:
            await autoscaler.stop()
        if admin is not None:
            admin[0].should_exit = True
            await admin[1]
        for router in routers:
            await router.stop()
        await controller.stop()
        import ray

        ray.shutdown()
        print("pdserve: stopped", flush=True)


async def _start_scaling(controller, scaling: ScalingOptions, host: str, router_metrics: str | None,
                         api_key: str | None = None):
    """The planner loop (with --autoscale) and the admin endpoint (unless --admin-port -1; with
    --api-key it needs the key too)."""
    from deploy.admin import build_admin_app, serve_admin

    autoscaler = None
    if scaling.planner is not None:
        from deploy.autoscaler import Autoscaler
        from planner.sla import SlaPlanner

        planner = SlaPlanner(scaling.planner, scaling.profile)
        reps = controller.replicas()
        planner.adopt(0.0, reps.get("prefill", {}).get("ready", 0),
                      reps.get("decode", reps.get("agg", {})).get("ready", 1))   # start from what runs
        autoscaler = Autoscaler(controller, planner, f"http://{router_metrics}/metrics",
                                load_interval_s=min(5.0, scaling.planner.interval_s))
        autoscaler.start()
    admin = None
    if scaling.admin_port is not None:
        admin = await serve_admin(build_admin_app(controller, autoscaler, api_key), host, scaling.admin_port)
    return autoscaler, admin


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


def parse_resources(text: str, flag: str) -> tuple[tuple[str, float], ...]:
    """'{"prefill": 1}' -> (("prefill", 1.0),); UserError naming the flag for anything else."""
    import json

    if not text:
        return ()
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict) or not doc:
            raise ValueError("not a non-empty object")
        items = tuple(sorted((str(k), float(v)) for k, v in doc.items()))
    except (ValueError, TypeError) as e:
        raise UserError(f"{flag} {text!r}: expected a JSON object of resource names to amounts, "
                        f"e.g. '{{\"prefill\": 1}}' ({e})") from None
    if any(v <= 0 for _, v in items) or any(k in ("CPU", "GPU", "memory") for k, _ in items):
        raise UserError(f"{flag}: amounts must be > 0 and names custom (CPU/GPU have their own flags)")
    return items
