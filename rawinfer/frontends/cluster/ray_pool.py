"""Engine replicas as Ray actors (`pip install 'rawinfer[ray]'`).

Each replica is one actor that loads the model and runs the ordinary `Server` (ZeroMQ loop, engine thread)
on a port of its node; the router reaches it there, so tokens never pass through Ray. Ray places the
actors (a CPU replica reserves `cpus` cores, a CUDA replica one GPU) and restarts an actor whose process
dies (`max_restarts`); the restarted actor loads the model again and binds a new port, which endpoint()
reports. Ray is imported only here, so the rest of rawinfer runs without it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from rawinfer.settings import check_options, float_argument, int_argument, is_int, is_number, option, optional

if TYPE_CHECKING:
    from rawinfer.config import EngineConfig
    from rawinfer.frontends.disagg.connector import DecodeConfig
    from rawinfer.frontends.disagg.prefill import PrefillConfig
    from rawinfer.frontends.server.config import ServerConfig

log = logging.getLogger("rawinfer")


@dataclass
class ReplicaSpec:
    """What an actor serves, built and checked by the command before any actor starts: the configs travel
    (they pickle), so an actor parses no command line."""

    model: str                              # the converted model's folder, the same path on every node
    engine: EngineConfig
    server: ServerConfig                    # its bind becomes a port of the actor's node
    decode: DecodeConfig | None = None      # a decode replica's link to the prefill instances; None: colocated
    prefill: PrefillConfig | None = None    # a prefill instance's; its bind becomes the instance's fixed port
    log_level: int = logging.INFO


# (ReplicaSpec) -> (LLMEngine, the decode link or None): the command line's, passed in so that this package
# does not import the command line
Build = Callable[[ReplicaSpec], tuple]


class ReplicaActor:
    """The body of one replica actor (made a Ray actor class by RayPool)."""

    def __init__(self, spec: ReplicaSpec, slot: int, bind_host: str | None, build: Build):
        bind_host = _actor_setup(spec, f"replica {slot}", bind_host)
        from rawinfer.frontends.server.server import Server
        engine, connector = build(spec)
        # the command's server options on a port of this node; its clients are the router, not the users
        cfg = dataclasses.replace(spec.server, bind=f"tcp://{bind_host}:0", curve_client_keys_dir=None)
        self.server = Server(engine, cfg, kv_connector=connector)
        self.thread = threading.Thread(target=self.server.run, name="rawinfer-replica", daemon=True)
        self.thread.start()
        self.facts = {"pid": os.getpid(), "node": bind_host, "device": engine.backend.name}

    def endpoint(self) -> tuple[str, dict]:
        return self.server.endpoint, self.facts

    def stop(self) -> bool:
        """Abort what is in flight (the router has drained it already) and stop serving."""
        self.server.shutdown()
        self.thread.join(60)
        return not self.thread.is_alive()


_count = {"parse": int_argument, "check": lambda v: is_int(v) and v >= 1, "what": "a positive integer"}
_count_or_none = {**_count, "check": optional(_count["check"]), "what": "a positive integer or None"}


@dataclass
class RayPoolConfig:
    """Where the replicas run; the fields with a flag are `rawinfer serve --replicas`'s."""

    address: str | None = option(
        None, flag="--ray-address", parse=str, metavar="ADDR", check=optional(lambda v: isinstance(v, str) and v != ""),
        what="a Ray address (auto, HOST:6379 or ray://HOST:10001) or None",
        help="join this Ray cluster (auto, HOST:6379 or ray://HOST:10001); the model path must exist on every node "
             "(default: start a local cluster on this machine)")
    num_cpus: int | None = option(
        None, flag="--ray-num-cpus", metavar="N", **_count_or_none,
        help="CPUs of the local Ray cluster (default: all of this machine's)")
    cpus: float = option(1.0, flag="--replica-cpus", parse=float_argument, metavar="N", cli_default=None,
                         check=lambda v: is_number(v) and v > 0, what="a positive number",
                         help="CPUs each CPU replica reserves and computes on (default: the cluster's CPUs / "
                              "replicas, at least 1)")
    prefill_replicas: int | None = option(
        None, flag="--prefill-replicas", metavar="P", **_count_or_none,
        help="also run P prefill instances as actors; the --replicas then run as decode instances that send them "
             "their prompts (prefill/decode disaggregation; the --role decode options apply) (default: none, "
             "colocated replicas)")
    prefill_port: int = option(5600, flag="--prefill-port", metavar="PORT", **_count,
                               help="with --prefill-replicas on a cluster (--ray-address): prefill instance i binds "
                                    "PORT + i on its node, the same port again after a restart (default: 5600; a "
                                    "local cluster picks free ports)")
    gpus: int = option(0, flag=None, check=lambda v: is_int(v) and v >= 0, what="a whole number >= 0",
                       help="GPUs per replica (1 for CUDA replicas)")
    max_restarts: int = option(-1, flag=None, check=lambda v: is_int(v) and v >= -1, what="a whole number >= -1",
                               help="restarts of a dead replica Ray makes; -1: every time")
    loopback: bool = option(True, flag=None, check=lambda v: isinstance(v, bool), what="true or false",
                            help="replicas bind 127.0.0.1 (all on this machine) or their node's address")


class RayPool:
    """ReplicaPool (pool.py) on Ray."""

    def __init__(self, cfg: RayPoolConfig, build: Build | None = None, spec: ReplicaSpec | None = None):
        """spec: what the replicas serve; set before the first start()."""
        check_options(cfg, "Ray pool option")
        try:
            import ray
        except ImportError:
            raise RuntimeError("--replicas runs replicas on Ray, which is not installed: "
                               "pip install 'rawinfer[ray]'") from None
        self.ray, self.cfg, self.spec, self.build = ray, cfg, spec, build
        self._started_ray = False
        if not ray.is_initialized():
            kw = {"address": cfg.address} if cfg.address else {"num_cpus": cfg.num_cpus or os.cpu_count()}
            if not cfg.address:      # Ray lowers its workers' priority (nice 15); replicas are the machine's work
                os.environ.setdefault("RAY_worker_niceness", "0")
            ray.init(include_dashboard=False, logging_level=logging.WARNING, **kw)
            self._started_ray = True
        self._reapers = self._start_reapers() if self._started_ray and not cfg.address else []
        self._actor_cls = ray.remote(ReplicaActor)
        self.actors: dict[int, object] = {}
        self.prefill_actors: list = []

    @staticmethod
    def _start_reapers() -> list:
        """A reaper (reaper.py) for each raylet of the local cluster just started: what Ray leaves running when
        this process is killed is stopped at once, not a minute later. Linux only (it reads /proc)."""
        if not sys.platform.startswith("linux"):
            return []
        from rawinfer.frontends.cluster import reaper
        return [reaper.start(pid) for pid in reaper.raylets_of(os.getpid())]

    def resources(self) -> dict:
        return dict(self.ray.cluster_resources())

    def start(self, slot: int) -> None:
        host = "127.0.0.1" if self.cfg.loopback else None      # None: the actor's own node's address
        self.actors[slot] = self._actor_cls.options(
            num_cpus=self.cfg.cpus, num_gpus=self.cfg.gpus, max_restarts=self.cfg.max_restarts,
            max_concurrency=4).remote(self.spec, slot, host, self.build)

    def endpoint(self, slot: int, timeout_s: float) -> tuple[str, dict]:
        ray = self.ray
        actor = self.actors.get(slot)
        if actor is None:
            raise RuntimeError(f"replica {slot} was never started")
        deadline = time.monotonic() + timeout_s
        last = "it did not answer"
        while time.monotonic() < deadline:
            try:
                return tuple(ray.get(actor.endpoint.remote(), timeout=max(0.1, deadline - time.monotonic())))
            except ray.exceptions.GetTimeoutError:
                break
            except ray.exceptions.ActorDiedError as e:
                if "max_restarts" in str(e) or self.cfg.max_restarts == 0:
                    raise RuntimeError(f"replica {slot} died and will not be restarted: {_short(e)}") from None
                last = _short(e)
            except ray.exceptions.RayActorError as e:    # restarting: ask again
                last = _short(e)
            time.sleep(0.5)
        raise RuntimeError(f"replica {slot} did not serve within {timeout_s:g} s ({last}); is the cluster short "
                           "of CPUs or GPUs for it? see `ray status`")

    def stop(self, slot: int) -> None:
        actor = self.actors.pop(slot, None)
        if actor is None:
            return
        try:
            self.ray.get(actor.stop.remote(), timeout=60)
        except Exception as e:           # already dead, or stuck: it is killed below either way
            log.debug("replica %d stop: %s", slot, e)
        self.ray.kill(actor, no_restart=True)

    def start_prefill_pool(self, spec: ReplicaSpec, timeout_s: float) -> list[str]:
        """The cfg.prefill_replicas prefill instances (--role prefill) as actors, each on a fixed port so that a
        restarted one is found again where the decode replicas look; their endpoints, once all serve."""
        host = "127.0.0.1" if self.cfg.loopback else None
        cls = self.ray.remote(PrefillActor)
        for i, port in enumerate(self._prefill_ports()):
            self.prefill_actors.append(cls.options(
                num_cpus=self.cfg.cpus, num_gpus=self.cfg.gpus, max_restarts=self.cfg.max_restarts,
                max_concurrency=2).remote(spec, i, host, port, self.build))
        try:
            return [e for e, _ in self.ray.get([a.endpoint.remote() for a in self.prefill_actors], timeout=timeout_s)]
        except self.ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"the prefill replicas did not serve within {timeout_s:g} s; see `ray status`") from None

    def _prefill_ports(self) -> list[int]:
        """cfg.prefill_port + i on a cluster's nodes; free ports of this machine for a local cluster."""
        n = self.cfg.prefill_replicas or 0
        if not self.cfg.loopback:
            return [self.cfg.prefill_port + i for i in range(n)]
        socks = [socket.socket() for _ in range(n)]
        try:
            for s in socks:
                s.bind(("127.0.0.1", 0))
            return [s.getsockname()[1] for s in socks]
        finally:
            for s in socks:
                s.close()

    def close(self) -> None:
        for slot in list(self.actors):
            self.ray.kill(self.actors.pop(slot), no_restart=True)
        for actor in self.prefill_actors:
            self.ray.kill(actor, no_restart=True)
        if self._started_ray:
            self.ray.shutdown()
        for proc in self._reapers:      # they end once the pipe closes, after one look for what is left
            proc.stdin.close()
        self._reapers = []


class PrefillActor:
    """The body of one prefill instance's actor: the disaggregation's PrefillServer on a fixed port."""

    def __init__(self, spec: ReplicaSpec, index: int, bind_host: str | None, port: int, build: Build):
        from rawinfer.frontends.disagg.prefill import PrefillServer
        bind_host = _actor_setup(spec, f"prefill {index}", bind_host)
        engine, _ = build(spec)
        self.server = PrefillServer(engine, dataclasses.replace(spec.prefill, bind=f"tcp://{bind_host}:{port}"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"warm": True}, name="rawinfer-prefill",
                                       daemon=True)
        self.thread.start()
        self.facts = {"pid": os.getpid(), "node": bind_host}

    def endpoint(self) -> tuple[str, dict]:
        return self.server.endpoint, self.facts


def _actor_setup(spec: ReplicaSpec, name: str, bind_host: str | None) -> str:
    """Logging as a server's (each line with its time and level), named after the actor; the address to bind
    (the node's, if not given)."""
    import ray

    from rawinfer.frontends.options import size_cpu_pool
    from rawinfer.frontends.server.activity import time_format
    size_cpu_pool(spec.engine.num_threads)           # before anything of the engine imports Numba
    logging.basicConfig(level=spec.log_level, format=time_format(f"rawinfer {name}"), force=True)
    return bind_host or ray.util.get_node_ip_address()


def _short(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
