"""`rawinfer serve --replicas`'s flags are generated from RouterConfig's, RayPoolConfig's, RoutingConfig's and
AutoscaleConfig's fields (settings.option) and read back into those configs: no flag is declared by hand, a
flag's default is its field's, a bad value is argparse's error naming the flag, and a config built in Python
is refused field by field. Nothing here starts Ray or a model."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections import Counter

import pytest

from rawinfer.frontends.cli.main import build_parser
from rawinfer.frontends.cli.serve_replicas import (check_replica_args, ray_pool_config, replica_configs,
                                                   router_config)
from rawinfer.frontends.cluster.autoscale import AutoscaleConfig
from rawinfer.frontends.cluster.ray_pool import RayPool, RayPoolConfig
from rawinfer.frontends.cluster.router import ReplicaRouter, RouterConfig
from rawinfer.frontends.cluster.routing import Router, RoutingConfig
from rawinfer.frontends.options import CLIError
from rawinfer.frontends.server.config import ServerConfig
from rawinfer.settings import flag_of, specs

# what users have typed since the flags were written by hand: the same names, the same defaults
USER_FLAGS = {"--replicas": None, "--ray-address": None, "--ray-num-cpus": None, "--replica-cpus": None,
              "--routing": "cache_aware", "--max-replicas": None, "--autoscale-max": None,
              "--autoscale-queue-depth": 8.0, "--autoscale-up-after": 10.0, "--autoscale-down-after": 60.0,
              "--prefill-replicas": None, "--prefill-port": 5600, "--replica-lost-after": 5.0}


def serve_parser() -> argparse.ArgumentParser:
    parser = build_parser("serve")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def replica_actions(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    group = next(g for g in p._action_groups if g.title.startswith("replicas on a Ray cluster"))
    return {a.option_strings[0]: a for a in group._group_actions}


def test_every_replica_flag_is_a_config_field_with_its_default():
    p = serve_parser()
    actions = replica_actions(p)
    generated = {}
    for cls, prefix in replica_configs():
        for name, spec in specs(cls):
            flag = flag_of(name, spec)
            if flag is not None:
                generated[flag] = (cls, prefix + name)
    assert set(actions) == set(generated) == set(USER_FLAGS)
    defaults = p.parse_args([])
    for flag, (cls, dest) in generated.items():
        assert actions[flag].dest == dest
        assert getattr(defaults, dest) == USER_FLAGS[flag], flag
    field_defaults = {f.name: f.default for f in dataclasses.fields(RouterConfig)}
    assert (field_defaults["lost_after_s"], RoutingConfig().policy) == (5.0, "cache_aware")
    assert (AutoscaleConfig(1, 2).up_depth, RayPoolConfig().prefill_port) == (8.0, 5600)
    # two configs' same-named fields (max_replicas) never share a parsed value
    assert [d for d, n in Counter(a.dest for a in p._actions).items() if n > 1] == []


def test_the_flags_build_the_configs():
    p = serve_parser()
    args = p.parse_args(["--replicas", "2", "--routing", "round_robin", "--autoscale-max", "5",
                         "--autoscale-queue-depth", "3", "--autoscale-up-after", "2.5", "--autoscale-down-after", "7",
                         "--replica-lost-after", "1.5", "--prefill-replicas", "1", "--prefill-port", "7000",
                         "--replica-cpus", "3", "--ray-num-cpus", "4"])
    check_replica_args(args)
    rcfg = router_config(args, local=True)
    assert (rcfg.replicas, rcfg.max_replicas, rcfg.lost_after_s, rcfg.routing.policy, rcfg.curve) == (
        2, 5, 1.5, "round_robin", None)
    assert rcfg.autoscale == AutoscaleConfig(2, 5, up_depth=3.0, up_after_s=2.5, down_after_s=7.0)
    pool = ray_pool_config(args, local=True)
    assert (pool.address, pool.num_cpus, pool.cpus, pool.prefill_replicas, pool.prefill_port, pool.loopback) == (
        None, 4, 3.0, 1, 7000, True)
    plain = router_config(p.parse_args(["--replicas", "3", "--max-replicas", "9"]), local=True)
    assert (plain.replicas, plain.max_replicas, plain.autoscale, plain.routing) == (3, 9, None, RoutingConfig())
    assert router_config(p.parse_args(["--replicas", "3"]), local=True).max_replicas == RouterConfig().max_replicas
    assert ray_pool_config(p.parse_args(["--replicas", "1", "--ray-address", "auto"]), local=False) == RayPoolConfig(
        address="auto", loopback=False)


@pytest.mark.parametrize("argv", [["--replicas", "0"], ["--replicas", "x"], ["--routing", "random"],
                                  ["--autoscale-max", "0"], ["--autoscale-queue-depth", "0"],
                                  ["--autoscale-up-after", "-1"], ["--replica-cpus", "0"], ["--ray-num-cpus", "1.5"],
                                  ["--prefill-replicas", "0"], ["--prefill-port", "x"], ["--replica-lost-after", "0"]])
def test_a_bad_flag_value_is_refused_by_the_parser_naming_the_flag(argv, capsys):
    with pytest.raises(SystemExit):
        serve_parser().parse_args(argv)
    assert argv[0] in capsys.readouterr().err


def test_flags_that_do_not_go_together_are_refused_before_anything_starts():
    p = serve_parser()
    for argv, says in ((["--autoscale-max", "3"], "--autoscale-max applies to replicas"),
                       (["--replica-cpus", "2"], "--replica-cpus applies to replicas"),
                       (["--prefill-replicas", "1"], "--prefill-replicas applies to replicas"),
                       (["--replicas", "3", "--autoscale-max", "2"], "below --replicas 3"),
                       (["--replicas", "3", "--max-replicas", "2"], "--max-replicas 2 is below"),
                       (["--replicas", "2", "--ray-address", "auto", "--ray-num-cpus", "2"], "sizes a local"),
                       (["--replicas", "2", "--role", "prefill"], "placed for you")):
        with pytest.raises(CLIError, match=says):
            check_replica_args(p.parse_args(argv))


def test_configs_built_in_python_are_refused_by_field_name():
    with pytest.raises(ValueError, match="min_match=2"):
        Router(RoutingConfig(min_match=2))
    with pytest.raises(ValueError, match="unknown routing policy"):
        Router(RoutingConfig(policy="random"))
    with pytest.raises(ValueError, match="up_depth=0"):
        AutoscaleConfig(1, 3, up_depth=0)
    with pytest.raises(ValueError, match="minimum replicas"):
        AutoscaleConfig(3, 2)
    with pytest.raises(ValueError, match="lost_after_s=0"):
        ReplicaRouter(ServerConfig(), None, RouterConfig(lost_after_s=0))
    with pytest.raises(ValueError, match="routing="):
        ReplicaRouter(ServerConfig(), None, RouterConfig(routing="cache_aware"))
    with pytest.raises(ValueError, match="cpus=0"):
        RayPool(RayPoolConfig(cpus=0))


def test_what_travels_to_the_actors_is_typed_configs_built_from_the_flags():
    """The replicas get a ReplicaSpec (the engine's, the server's and the roles' configs, checked here), not
    the parsed arguments; it pickles, as Ray sends it."""
    import pickle

    from rawinfer.frontends.cli.serve_replicas import replica_spec
    p = build_parser("serve")
    args = p.parse_args(["serve", "--replicas", "2", "--prefill-replicas", "1", "--min-remote-tokens", "8",
                         "--kv-transfer-timeout", "2.5", "--prefill-max-queued", "5", "--block-size", "32", "-q"])
    server = ServerConfig(bind="tcp://127.0.0.1:5999", heartbeat_interval_s=0.5)
    decode = replica_spec(args, server, "/models/m", 3.0, "cpu", ["tcp://127.0.0.1:7000"])
    assert (decode.model, decode.server, decode.prefill) == ("/models/m", server, None)
    assert (decode.engine.device, decode.engine.num_threads, decode.engine.block_size) == ("cpu", 3, 32)
    assert (decode.decode.prefill, decode.decode.min_remote_tokens, decode.decode.transfer_timeout_s) == (
        ["tcp://127.0.0.1:7000"], 8, 2.5)
    assert pickle.loads(pickle.dumps(decode)) == decode
    prefill = replica_spec(args, server, "/models/m", 3.0, "cpu", role="prefill")
    assert (prefill.decode, prefill.prefill.max_queued, prefill.prefill.insecure) == (None, 5, False)
    gpu = replica_spec(p.parse_args(["serve", "--replicas", "1", "--threads", "1"]), server, "/models/m", 1.0, "cuda")
    assert (gpu.engine.device, gpu.engine.num_threads, gpu.decode, gpu.prefill) == ("cuda", 1, None, None)
    assert (decode.log_level, gpu.log_level) == (logging.WARNING, logging.INFO)
