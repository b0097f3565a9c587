"""`rawinfer serve --replicas N`: engine replicas on a Ray cluster behind one router, and `rawinfer scale`.

    rawinfer serve --replicas 2                          # a local Ray cluster started for the purpose
    rawinfer serve --replicas 4 --ray-address auto       # the cluster this machine belongs to (`ray start`)
    rawinfer scale 3 --addr tcp://127.0.0.1:5555         # while serving: replicas added, or drained and stopped

The router (frontends/cluster/router.py) binds --bind as a single server would, and the HTTP front end
connects to it, so clients see one endpoint. The replicas take every engine option given here.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os

from rawinfer.frontends.cli.serve_roles import prefill_public_key
from rawinfer.frontends.options import CLIError, engine_config_from_args, is_quiet
from rawinfer.settings import add_options, options_from_args

log = logging.getLogger("rawinfer")


def replica_configs() -> tuple:
    """(dataclass, dest prefix) of each config whose option fields are the replica flags: each lands under a
    prefix of its own, so that two configs' same-named fields stay apart (the router's max_replicas beside the
    autoscaling rule's)."""
    from rawinfer.frontends.cluster.autoscale import AutoscaleConfig
    from rawinfer.frontends.cluster.ray_pool import RayPoolConfig
    from rawinfer.frontends.cluster.router import RouterConfig
    from rawinfer.frontends.cluster.routing import RoutingConfig
    return (RouterConfig, ""), (RayPoolConfig, "ray_"), (RoutingConfig, "routing_"), (AutoscaleConfig, "autoscale_")


def add_replica_args(p: argparse.ArgumentParser) -> None:
    """The replica flags, generated from the fields of RouterConfig, RayPoolConfig, RoutingConfig and
    AutoscaleConfig (settings.option)."""
    g = p.add_argument_group("replicas on a Ray cluster (pip install 'rawinfer[ray]')")
    for cls, prefix in replica_configs():
        add_options(g, cls, dest_prefix=prefix)


def check_replica_args(args) -> None:
    """CLIError for options that do not go together (before anything starts)."""
    auto_max = args.autoscale_max_replicas
    if args.replicas is None:
        given = [f for f, v in (("--ray-address", args.ray_address), ("--autoscale-max", auto_max),
                                ("--max-replicas", args.max_replicas), ("--replica-cpus", args.ray_cpus),
                                ("--prefill-replicas", args.ray_prefill_replicas)) if v is not None]
        if given:
            raise CLIError(f"{given[0]} applies to replicas; add --replicas N")
        return
    if args.role != "colocated" or args.prefill:
        raise CLIError("with --replicas the roles are placed for you: give --prefill-replicas P instead of --role "
                       "and --prefill (docs/scaling.md)")
    if auto_max is not None and auto_max < args.replicas:
        raise CLIError(f"--autoscale-max {auto_max} is below --replicas {args.replicas}; give at least "
                       f"{args.replicas}")
    top = max_replicas(args)
    if args.replicas > top or (auto_max or 0) > top:
        raise CLIError(f"--max-replicas {top} is below --replicas or --autoscale-max; raise it")
    if args.ray_address is not None and args.ray_num_cpus is not None:
        raise CLIError("--ray-num-cpus sizes a local cluster; an existing one (--ray-address) has its own CPUs")


def max_replicas(args) -> int:
    """--max-replicas, else --autoscale-max, else RouterConfig's default."""
    from rawinfer.frontends.cluster.router import RouterConfig
    return args.max_replicas or args.autoscale_max_replicas or RouterConfig().max_replicas


def replica_spec(args, server, model_path: str, cpus: float, device: str, prefill: list[str] | None = None,
                 role: str = "colocated"):
    """What every replica starts with (it travels to the actors): the engine options on `device` (on the CPU,
    as many threads as the replica's CPUs unless --threads says), the server's of --bind; with the endpoints
    of `prefill`, the decode link of a decode replica; role "prefill": the PrefillConfig of a prefill instance.
    CLIError naming the flag of a bad value."""
    from rawinfer.frontends.cluster.ray_pool import ReplicaSpec
    from rawinfer.frontends.disagg.connector import DecodeConfig
    from rawinfer.frontends.disagg.prefill import PrefillConfig
    engine = dataclasses.replace(engine_config_from_args(args), device=device)
    if device == "cpu" and engine.num_threads is None:
        engine = dataclasses.replace(engine, num_threads=max(1, int(cpus)))
    level = logging.DEBUG if getattr(args, "verbose", False) else logging.WARNING if is_quiet(args) else logging.INFO
    try:
        decode = options_from_args(DecodeConfig, args, "decode option", prefill=list(prefill),
                                   server_key=prefill_public_key(args)).validate() if prefill else None
        pre = options_from_args(PrefillConfig, args, "prefill option", dest_prefix="prefill_", insecure=args.insecure,
                                curve_secret_key_file=args.curve_secret_key_file) if role == "prefill" else None
    except ValueError as e:
        raise CLIError(str(e)) from None
    return ReplicaSpec(model_path, engine, server, decode=decode, prefill=pre, log_level=level)


def replica_engine(spec):
    """What an actor serves (ray_pool.ReplicaSpec): the engine, and its prefill link when it decodes."""
    from rawinfer.engine.engine import LLMEngine
    from rawinfer.frontends.disagg.connector import DecodeConnector
    log.info("starting the engine on %s", spec.model)
    engine = LLMEngine(spec.model, spec.engine)
    gc.collect()                         # as cli/models.py's open_engine: the engine's objects, out of the
    gc.freeze()                          # collector's sight for as long as the actor serves
    return engine, DecodeConnector(engine, spec.decode) if spec.decode is not None else None


def run_replicas(args, open_front) -> int:
    """Start the replicas and serve the router until SIGINT/SIGTERM. open_front(args): the checked
    ServerConfig of --bind and the started HTTP workers, as for one engine (cli/serve.py)."""
    from rawinfer.frontends.cli.models import resolve_model
    from rawinfer.frontends.cluster.router import ReplicaRouter

    check_replica_args(args)
    model_path = os.path.abspath(resolve_model(args.model, progress=not args.quiet))
    local = args.ray_address is None
    if not local and not args.curve_secret_key_file and not args.insecure:
        raise CLIError("replicas on other machines are reached over the network: give --curve-secret-key FILE "
                       "(the same file on every node; the router and replicas use it), or --insecure on a "
                       "trusted network")
    rcfg = router_config(args, local)
    cfg, workers = open_front(args)
    pool = None
    try:
        pool = _open_pool(args, local)
        res = pool.resources()
        device, cpus = _place_replicas(args, pool, res)
        prefill = _start_prefill(args, pool, cfg, model_path, cpus, device)
        pool.spec = replica_spec(args, cfg, model_path, cpus, device, prefill)
        log.info("Ray cluster: %g CPUs, %g GPUs; %d %s%s replica(s) of %s, %s each", res.get("CPU", 0),
                 res.get("GPU", 0), rcfg.replicas, device, " decode" if prefill else "",
                 os.path.basename(model_path), "1 GPU" if device == "cuda" else f"{cpus:g} CPU(s)")
        router = ReplicaRouter(cfg, pool, rcfg)
        pool = None                      # the router closes it
        return router.run()
    finally:
        if pool is not None:
            pool.close()
        if workers is not None:
            workers.stop()


def ray_pool_config(args, local: bool):
    """The RayPoolConfig of the flags; its per-replica CPUs are set once the cluster's are known
    (_place_replicas)."""
    from rawinfer.frontends.cluster.ray_pool import RayPoolConfig
    return _config(RayPoolConfig, args, "ray_", loopback=local, cpus=args.ray_cpus or RayPoolConfig().cpus)


def _open_pool(args, local: bool):
    """The Ray actor pool on --ray-address (or a local cluster), what its replicas serve still to be set."""
    from rawinfer.frontends.cluster.ray_pool import RayPool
    try:
        return RayPool(ray_pool_config(args, local), replica_engine)
    except RuntimeError as e:
        raise CLIError(str(e)) from None


def _place_replicas(args, pool, res: dict) -> tuple[str, float]:
    """The replicas' device and CPUs each, from the options and the cluster's resources; set on the pool."""
    device = args.device if args.device != "auto" else ("cuda" if res.get("GPU", 0) >= 1 else "cpu")
    engines = args.replicas + (pool.cfg.prefill_replicas or 0)
    cpus = args.ray_cpus or max(1.0, float(int(res.get("CPU", 1) // engines)))
    pool.cfg.cpus, pool.cfg.gpus = (1.0, 1) if device == "cuda" else (cpus, 0)
    return device, cpus


def _start_prefill(args, pool, server, model_path: str, cpus: float, device: str) -> list[str]:
    """Start the --prefill-replicas instances and return their endpoints (none without the option)."""
    if not pool.cfg.prefill_replicas:
        return []
    log.info("starting %d prefill replica(s)", pool.cfg.prefill_replicas)
    try:
        prefill = pool.start_prefill_pool(replica_spec(args, server, model_path, cpus, device, role="prefill"), 600.0)
    except RuntimeError as e:
        raise CLIError(str(e)) from None
    log.info("prefill replicas serving on %s", " ".join(prefill))
    return prefill


def router_config(args, local: bool):
    """The router's settings from the flags (RouterConfig with its RoutingConfig and, with --autoscale-max, its
    AutoscaleConfig) and, across machines, CURVE keys."""
    from rawinfer.frontends.cluster.autoscale import AutoscaleConfig
    from rawinfer.frontends.cluster.router import RouterConfig
    from rawinfer.frontends.cluster.routing import RoutingConfig
    from rawinfer.frontends.server.security import load_secret_key
    import zmq

    curve = None
    if args.curve_secret_key_file and not local:
        public, _ = load_secret_key(args.curve_secret_key_file)
        curve = (public, *zmq.curve_keypair())
    auto = None
    if args.autoscale_max_replicas is not None:
        auto = _config(AutoscaleConfig, args, "autoscale_", min_replicas=args.replicas)
    return _config(RouterConfig, args, "", max_replicas=max_replicas(args), curve=curve, autoscale=auto,
                   routing=_config(RoutingConfig, args, "routing_"))


def _config(cls, args, prefix: str, **given):
    """cls from its flags (under `prefix`) and the values given; CLIError naming the flag of a bad value."""
    try:
        return options_from_args(cls, args, "replica option", dest_prefix=prefix, **given)
    except ValueError as e:
        raise CLIError(str(e)) from None


def cmd_scale(args) -> int:
    from rawinfer.frontends.cli.connect import ping_server
    from rawinfer.frontends.client.client import Client, RequestError
    ping_server(args.addr, args.server_key, args.client_key)
    with Client(args.addr, server_key=args.server_key, client_key_file=args.client_key,
                timeout_s=args.timeout) as client:
        try:
            previous = client.scale(args.replicas)
        except RequestError as e:
            raise CLIError(str(e)) from None
    print(f"replicas: {previous} -> {args.replicas} (new ones serve once loaded; removed ones finish their "
          "requests first)")
    return 0
