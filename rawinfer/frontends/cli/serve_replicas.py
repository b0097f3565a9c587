"""`rawinfer serve --replicas N`: engine replicas on a Ray cluster behind one router, and `rawinfer scale`.

    rawinfer serve --replicas 2                          # a local Ray cluster started for the purpose
    rawinfer serve --replicas 4 --ray-address auto       # the cluster this machine belongs to (`ray start`)
    rawinfer scale 3 --addr tcp://127.0.0.1:5555         # while serving: replicas added, or drained and stopped

The router (frontends/cluster/router.py) binds --bind as a single server would, and the HTTP front end
connects to it, so clients see one endpoint. The replicas take every engine option given here.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket

from rawinfer.frontends.cli.models import open_engine
from rawinfer.frontends.cli.serve_roles import decode_connector
from rawinfer.frontends.options import CLIError, positive_float, positive_int

log = logging.getLogger("rawinfer")


def add_replica_args(p: argparse.ArgumentParser) -> None:
    from rawinfer.frontends.cluster.routing import POLICIES
    g = p.add_argument_group("replicas on a Ray cluster (pip install 'rawinfer[ray]')")
    g.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                   help="serve N engine replicas, each a Ray actor, behind one router on --bind (default: one engine "
                        "in this process, no Ray)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (auto, HOST:6379 or ray://HOST:10001); the model path must exist on "
                        "every node (default: start a local cluster on this machine)")
    g.add_argument("--ray-num-cpus", type=positive_int, default=None, metavar="N",
                   help="CPUs of the local Ray cluster (default: all of this machine's)")
    g.add_argument("--replica-cpus", type=positive_float, default=None, metavar="N",
                   help="CPUs each CPU replica reserves and computes on (default: the cluster's CPUs / replicas, "
                        "at least 1)")
    g.add_argument("--routing", choices=POLICIES, default="cache_aware",
                   help="cache_aware: to the replica most likely to hold the prompt's prefix, balanced against load; "
                        "round_robin; least_loaded (default: cache_aware)")
    g.add_argument("--max-replicas", type=positive_int, default=None, metavar="N",
                   help="`rawinfer scale` and autoscaling stay at or below N (default: --autoscale-max, else 64)")
    g.add_argument("--autoscale-max", type=positive_int, default=None, metavar="N",
                   help="add replicas up to N while requests per replica stay above --autoscale-queue-depth, and "
                        "remove them down to --replicas when idle (default: no autoscaling)")
    g.add_argument("--autoscale-queue-depth", type=positive_float, default=8.0, metavar="Q",
                   help="requests in flight per serving replica that count as a queue (default: 8)")
    g.add_argument("--autoscale-up-after", type=positive_float, default=10.0, metavar="SECONDS",
                   help="how long the queue must last before a replica is added (default: 10)")
    g.add_argument("--autoscale-down-after", type=positive_float, default=60.0, metavar="SECONDS",
                   help="how long replicas must stay idle before one is removed (default: 60)")
    g.add_argument("--prefill-replicas", type=positive_int, default=None, metavar="P",
                   help="also run P prefill instances as actors; the --replicas then run as decode instances that "
                        "send them their prompts (prefill/decode disaggregation; the --role decode options apply) "
                        "(default: none, colocated replicas)")
    g.add_argument("--prefill-port", type=positive_int, default=5600, metavar="PORT",
                   help="with --prefill-replicas on a cluster (--ray-address): prefill instance i binds PORT + i on "
                        "its node, the same port again after a restart (default: 5600; a local cluster picks free "
                        "ports)")
    g.add_argument("--replica-lost-after", type=positive_float, default=5.0, metavar="SECONDS",
                   help="a replica silent this long is taken out of the rotation, its requests retried or ended "
                        "(default: 5)")


def check_replica_args(args) -> None:
    """CLIError for options that do not go together (before anything starts)."""
    if args.replicas is None:
        given = [f for f, v in (("--ray-address", args.ray_address), ("--autoscale-max", args.autoscale_max),
                                ("--max-replicas", args.max_replicas), ("--replica-cpus", args.replica_cpus),
                                ("--prefill-replicas", args.prefill_replicas)) if v is not None]
        if given:
            raise CLIError(f"{given[0]} applies to replicas; add --replicas N")
        return
    if args.role != "colocated" or args.prefill:
        raise CLIError("with --replicas the roles are placed for you: give --prefill-replicas P instead of --role "
                       "and --prefill (docs/scaling.md)")
    if args.autoscale_max is not None and args.autoscale_max < args.replicas:
        raise CLIError(f"--autoscale-max {args.autoscale_max} is below --replicas {args.replicas}; give at least "
                       f"{args.replicas}")
    top = args.max_replicas or args.autoscale_max or 64
    if args.replicas > top or (args.autoscale_max or 0) > top:
        raise CLIError(f"--max-replicas {top} is below --replicas or --autoscale-max; raise it")
    if args.ray_address is not None and args.ray_num_cpus is not None:
        raise CLIError("--ray-num-cpus sizes a local cluster; an existing one (--ray-address) has its own CPUs")


def _replica_options(args, model_path: str, cpus: float, device: str, prefill: list[str]) -> dict:
    """The engine and server options every replica starts with (a plain dict: it travels to the actors);
    with prefill endpoints, those of a decode instance."""
    opts = {k: v for k, v in vars(args).items() if k != "func"}
    opts.update(model=model_path, device=device, http=False, role="decode" if prefill else "colocated",
                prefill=list(prefill))
    if device == "cpu" and opts.get("num_threads") is None:
        opts["num_threads"] = max(1, int(cpus))
    return opts


def replica_engine(args):
    """What a replica actor serves: the engine of the options, and its prefill link when it decodes."""
    engine = open_engine(args)
    return engine, decode_connector(args, engine)


def _prefill_ports(args, local: bool) -> list[int]:
    if not local:
        return [args.prefill_port + i for i in range(args.prefill_replicas)]
    socks = [socket.socket() for _ in range(args.prefill_replicas)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


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
    cfg, workers = open_front(args)
    pool = None
    try:
        pool = _open_pool(args, local)
        res = pool.resources()
        device, cpus = _place_replicas(args, pool, res)
        prefill = _start_prefill(args, pool, model_path, cpus, device, local)
        pool.options = _replica_options(args, model_path, cpus, device, prefill)
        rcfg = _router_config(args, local)
        log.info("Ray cluster: %g CPUs, %g GPUs; %d %s%s replica(s) of %s, %s each", res.get("CPU", 0),
                 res.get("GPU", 0), args.replicas, device, " decode" if prefill else "",
                 os.path.basename(model_path), "1 GPU" if device == "cuda" else f"{cpus:g} CPU(s)")
        router = ReplicaRouter(cfg, pool, rcfg)
        pool = None                      # the router closes it
        return router.run()
    finally:
        if pool is not None:
            pool.close()
        if workers is not None:
            workers.stop()


def _open_pool(args, local: bool):
    """The Ray actor pool on --ray-address (or a local cluster), its replica options still to be set."""
    from rawinfer.frontends.cluster.ray_pool import RayPool, RayPoolConfig
    try:
        return RayPool({}, RayPoolConfig(address=args.ray_address, num_cpus=args.ray_num_cpus, loopback=local),
                       replica_engine)
    except RuntimeError as e:
        raise CLIError(str(e)) from None


def _place_replicas(args, pool, res: dict) -> tuple[str, float]:
    """The replicas' device and CPUs each, from the options and the cluster's resources; set on the pool."""
    device = args.device if args.device != "auto" else ("cuda" if res.get("GPU", 0) >= 1 else "cpu")
    engines = args.replicas + (args.prefill_replicas or 0)
    cpus = args.replica_cpus or max(1.0, float(int(res.get("CPU", 1) // engines)))
    pool.cfg.cpus, pool.cfg.gpus = (1.0, 1) if device == "cuda" else (cpus, 0)
    return device, cpus


def _start_prefill(args, pool, model_path: str, cpus: float, device: str, local: bool) -> list[str]:
    """Start the --prefill-replicas instances and return their endpoints (none without the option)."""
    if not args.prefill_replicas:
        return []
    log.info("starting %d prefill replica(s)", args.prefill_replicas)
    try:
        prefill = pool.start_prefill_pool(_replica_options(args, model_path, cpus, device, []),
                                          _prefill_ports(args, local), open_engine, 600.0)
    except RuntimeError as e:
        raise CLIError(str(e)) from None
    log.info("prefill replicas serving on %s", " ".join(prefill))
    return prefill


def _router_config(args, local: bool):
    """The router's settings: routing policy, loss timeout, autoscaling and, across machines, CURVE keys."""
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
    if args.autoscale_max is not None:
        auto = AutoscaleConfig(args.replicas, args.autoscale_max, up_depth=args.autoscale_queue_depth,
                               up_after_s=args.autoscale_up_after, down_after_s=args.autoscale_down_after)
    return RouterConfig(replicas=args.replicas, max_replicas=args.max_replicas or args.autoscale_max or 64,
                        routing=RoutingConfig(policy=args.routing), lost_after_s=args.replica_lost_after,
                        autoscale=auto, curve=curve)


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
