"""`rawinfer bench throughput | serve | roofline | step-overhead`'s own flags are generated from the fields of
ThroughputConfig, ServeBenchConfig, RooflineConfig and StepOverheadConfig (settings.option) and read back into those configs: the
flags users have typed keep their names and defaults, every one is a field, a bad value is argparse's error
naming the flag, and a config built in Python is refused field by field by the benchmark. Nothing here
starts an engine or a server."""

from __future__ import annotations

import argparse
import math

import pytest

from rawinfer.frontends.bench.roofline import RooflineConfig
from rawinfer.frontends.bench.roofline import report as roofline_report
from rawinfer.frontends.bench.serve import MIXED_FIELDS, MULTITURN_FIELDS, ServeBenchConfig, run_config
from rawinfer.frontends.bench.step_overhead import StepOverheadConfig
from rawinfer.frontends.bench.step_overhead import run as step_overhead_run
from rawinfer.frontends.bench.throughput import WORKLOAD_FIELDS, ThroughputConfig, WorkloadConfig
from rawinfer.frontends.bench.throughput import run as throughput_run
from rawinfer.frontends.cli.main import build_parser
from rawinfer.settings import api_key_default, flag_of, options_from_args, specs

WORKLOAD = {"--num-requests": 64, "--input-len": 128, "--output-len": 128, "--range-ratio": 0.0, "--seed": 0}
# what users have typed since the flags were written by hand: the same names, the same defaults
USER_FLAGS = {
    "throughput": (ThroughputConfig, {**WORKLOAD, "--shared-prefix": 0, "--compare-single": False,
                                      "--no-warmup": True, "--structured-output": False}),
    "serve": (ServeBenchConfig, {**WORKLOAD, "--num-requests": 200, "--backend": "zmq",
                                 "--addr": "tcp://127.0.0.1:5555", "--base-url": "http://127.0.0.1:8000",
                                 "--api-key": api_key_default(), "--server-key": None, "--request-rate": math.inf,
                                 "--long-fraction": 0.0, "--long-input-len": 2048, "--long-output-len": 32,
                                 "--slo-ttft-ms": 1000.0, "--slo-itl-ms": 200.0, "--conversations": 0, "--turns": 4,
                                 "--turn-input-len": 64, "--stats-interval": 0.25, "--timeout": 120.0,
                                 "--no-warmup": True}),
    "roofline": (RooflineConfig, {"--prompt-len": 500, "--batch": None, "--context": 128,
                                  "--workload": (64, 128, 128)}),
    "step-overhead": (StepOverheadConfig, {"--batch-sizes": (1, 64, 256), "--steps": 200, "--warmup-steps": 20,
                                           "--prompt-len": 128, "--seed": 0}),
}
# the flags each bench shares with other commands, declared elsewhere (the engine's, -q/-v, the results')
ELSEWHERE = ("-h", "-q", "-v", "--output-dir", "--json", "--figure")


def bench_parser(name: str) -> argparse.ArgumentParser:
    parser = build_parser("bench")
    bench = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    return next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def engine_flags() -> set[str]:
    from rawinfer.frontends.options import add_engine_args
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return {f for a in p._actions for f in a.option_strings}


@pytest.mark.parametrize("name", list(USER_FLAGS))
def test_every_bench_flag_is_a_config_field_with_its_default(name):
    cls, user = USER_FLAGS[name]
    p = bench_parser(name)
    actions = {a.option_strings[0]: a for a in p._actions if a.option_strings}
    own = {f for f in actions if f not in ELSEWHERE and f not in engine_flags()}
    generated = {flag_of(n, s): n for n, s in specs(cls) if flag_of(n, s) is not None}
    assert own == set(generated) == set(user)
    defaults = p.parse_args([])
    for flag, field in generated.items():
        assert actions[flag].dest == field, flag
        value = getattr(defaults, field)
        assert value == user[flag] or (flag == "--no-warmup" and value is True), flag
    # the config the defaults build is the dataclass's own (but the key read from the environment)
    assert options_from_args(cls, defaults, "bench option") == cls(**(
        {"api_key": api_key_default()} if cls is ServeBenchConfig else {}))


def test_the_serve_flags_stay_in_their_help_groups():
    groups = {g.title: {a.dest for a in g._group_actions} for g in bench_parser("serve")._action_groups}
    assert groups["workload"] == set(WORKLOAD_FIELDS)
    assert groups["mixed workload and service-level objectives"] == set(MIXED_FIELDS)
    assert groups["multi-turn conversations"] == set(MULTITURN_FIELDS)
    assert {"backend", "addr", "request_rate", "timeout", "warmup"} <= groups["options"]
    assert bench_parser("throughput")._action_groups[2].title == "workload"


def test_the_flags_build_the_configs():
    args = bench_parser("throughput").parse_args(["--num-requests", "3", "--range-ratio", "0.5", "--seed", "7",
                                                  "--shared-prefix", "16", "--compare-single", "--no-warmup"])
    cfg = options_from_args(ThroughputConfig, args, "bench option")
    assert cfg == ThroughputConfig(num_requests=3, range_ratio=0.5, seed=7, shared_prefix=16, compare_single=True,
                                   warmup=False)
    assert isinstance(cfg, WorkloadConfig)
    args = bench_parser("serve").parse_args(["--backend", "openai", "--api-key", "k", "--request-rate", "2.5",
                                             "--long-fraction", "0.25", "--conversations", "3", "--turns", "2",
                                             "--timeout", "9"])
    cfg = options_from_args(ServeBenchConfig, args, "bench option")
    assert (cfg.backend, cfg.api_key, cfg.request_rate, cfg.long_fraction, cfg.conversations, cfg.turns,
            cfg.timeout, cfg.num_requests, cfg.warmup) == ("openai", "k", 2.5, 0.25, 3, 2, 9.0, 200, True)
    assert "api_key" not in run_config(cfg) and run_config(cfg)["request_rate"] == 2.5     # what a report keeps
    args = bench_parser("step-overhead").parse_args(["--batch-sizes", "1,8", "--steps", "20", "--warmup-steps", "0"])
    assert options_from_args(StepOverheadConfig, args, "bench option") == StepOverheadConfig(
        batch_sizes=(1, 8), steps=20, warmup_steps=0)
    roofline = bench_parser("roofline")        # --batch repeats; none given: 1 and 64
    cfg = options_from_args(RooflineConfig, roofline.parse_args(["--batch", "3", "--batch", "5", "--workload", "0"]),
                            "bench option")
    assert (cfg.batch, cfg.batches, cfg.workload) == ([3, 5], [3, 5], None)
    cfg = options_from_args(RooflineConfig, roofline.parse_args(["--workload", "4x16/8", "--context", "9"]),
                            "bench option")
    assert (cfg.batches, cfg.workload, cfg.context, cfg.prompt_len) == ([1, 64], (4, 16, 8), 9, 500)


@pytest.mark.parametrize("name,argv,says", [
    ("throughput", ["--num-requests", "0"], "must be at least 1, got 0"),
    ("throughput", ["--range-ratio", "1"], "must be a number in [0, 1), got 1"),
    ("throughput", ["--shared-prefix", "-1"], "must be 0 or more, got -1"),
    ("serve", ["--request-rate", "0"], "must be a positive number, got 0"),
    ("serve", ["--backend", "grpc"], "grpc"),
    ("serve", ["--long-fraction", "1.5"], "must be a number in [0, 1], got 1.5"),
    ("serve", ["--turns", "0"], "must be at least 1, got 0"),
    ("serve", ["--slo-itl-ms", "-5"], "must be a positive number, got -5"),
    ("serve", ["--stats-interval", "nan"], "must be a positive number, got nan"),
    ("roofline", ["--batch", "0"], "must be at least 1, got 0"),
    ("roofline", ["--workload", "64x128"], "expected N x P / O with positive integers"),
    ("roofline", ["--context", "x"], "'x' is not a whole number"),
    ("step-overhead", ["--batch-sizes", "0,4"], "expected positive integers separated by commas"),
    ("step-overhead", ["--batch-sizes", ""], "expected positive integers separated by commas"),
    ("step-overhead", ["--warmup-steps", "x"], "'x' is not a whole number"),
])
def test_a_bad_flag_value_is_refused_by_the_parser_naming_the_flag(name, argv, says, capsys):
    with pytest.raises(SystemExit):
        bench_parser(name).parse_args(argv)
    err = capsys.readouterr().err
    assert f"argument {argv[0]}: " in err and says in err


def test_a_bad_value_from_parsed_arguments_is_named_by_its_flag():
    args = bench_parser("step-overhead").parse_args([])
    args.steps = 0                  # what no parser gives, but a caller of options_from_args may
    with pytest.raises(ValueError, match=r"^--steps=0 is invalid: it must be a positive integer$"):
        options_from_args(StepOverheadConfig, args, "bench option")


def test_configs_built_in_python_are_refused_by_field_name():
    with pytest.raises(ValueError, match=r"step-overhead option batch_sizes=\(\) is invalid"):
        step_overhead_run("/no/model", None, StepOverheadConfig(batch_sizes=()))
    with pytest.raises(ValueError, match=r"roofline option batch=\[\] is invalid"):
        roofline_report(None, RooflineConfig(batch=[]))
    with pytest.raises(ValueError, match=r"roofline option workload=\(4, 0, 8\) is invalid"):
        roofline_report(None, RooflineConfig(workload=(4, 0, 8)))
    with pytest.raises(ValueError, match="throughput option range_ratio=1.0 is invalid: it must be a number in"):
        throughput_run(None, ThroughputConfig(range_ratio=1.0))
    import asyncio

    from rawinfer.frontends.bench.serve import run_load
    with pytest.raises(ValueError, match="bench serve option request_rate=0 is invalid"):
        asyncio.run(run_load(ServeBenchConfig(request_rate=0)))
    with pytest.raises(ValueError, match="bench serve option backend='grpc' is invalid: it must be zmq or openai"):
        asyncio.run(run_load(ServeBenchConfig(backend="grpc")))
