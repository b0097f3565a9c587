"""What a one-shot command waits for before its answer: the parser of its own command only, a warm-up of
its own request's steps (and a word when a kernel compiles after it), a KV region sized for it, no CuPy
import where no CUDA driver is, no ml_dtypes import for a float model, the collector kept off what lives
as long as the process."""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import subprocess
import sys

import pytest

from cli_util import ROOT, env

PROMPT = [5, 17, 3, 99, 42, 7, 250, 11, 64, 8, 31, 2, 77, 19, 101, 6, 45, 12, 90, 33, 4]


def _choices(parser: argparse.ArgumentParser) -> list[str]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(sub.choices)


def test_a_command_builds_its_own_group_of_the_parser_alone():
    from rawinfer.frontends.cli.main import COMMANDS, build_parser, named_command
    every = _choices(build_parser())
    assert sorted(every) == sorted(name for names, _ in COMMANDS for name in names)
    for names, _ in COMMANDS:
        for name in names:
            assert named_command(["-q", name, "--help"]) == name
            assert _choices(build_parser(name)) == list(names)
    assert named_command(["generat", "hi"]) is None and named_command(["-v"]) is None and named_command([]) is None


ONE_SHOT = """
import json, sys
from rawinfer import LLMEngine, SamplingParams
from rawinfer.backend.cpu.cache import _dispatchers
from rawinfer.engine.warmup import warm_up_like
model, n, warm = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "warm"
prompt = json.loads(sys.argv[4])
params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, n=n, ignore_eos=True)
engine = LLMEngine(model, device="cpu", kv_cache_memory="8MiB", warmup=False)
free = engine.block_manager.num_free_blocks
if warm:
    warm_up_like(engine, len(prompt), params)
left = engine.has_unfinished() or engine.block_manager.num_free_blocks != free
builds = lambda: sum(len(d.overloads) for d in _dispatchers())   # kernel builds in memory
before = builds()
engine.add_request("r", prompt, params)
out = {}
while engine.has_unfinished():
    for o in engine.step():
        out.setdefault(o.index, []).extend(o.new_token_ids)
print(json.dumps({"left": left, "loaded": builds() - before, "tokens": [out[i] for i in sorted(out)]}))
"""


def one_shot(model: str, n: int, warm: bool) -> dict:
    """A fresh process's engine without a warm-up, warmed by warm_up_like for PROMPT or not: what the
    request then loads (kernel builds), whether the warm-up left anything, the tokens."""
    import json
    r = subprocess.run([sys.executable, "-c", ONE_SHOT, model, str(n), "warm" if warm else "cold", json.dumps(PROMPT)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env())
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.parametrize("n", [1, 2])
def test_warm_up_like_leaves_the_request_nothing_to_load_and_no_trace(tiny_llama_dir, n):
    """After a warm-up shaped like the request (prompt length, samples), the request loads or compiles no
    kernel build (without it, it does), and gets the tokens an engine warmed up for everything gives it."""
    from rawinfer import LLMEngine, SamplingParams
    warm, cold = one_shot(tiny_llama_dir, n, True), one_shot(tiny_llama_dir, n, False)
    assert warm["left"] is False and warm["loaded"] == 0 and cold["loaded"] > 0
    full = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="8MiB")
    full.add_request("r", PROMPT, SamplingParams(max_tokens=6, temperature=0.8, seed=3, n=n, ignore_eos=True))
    out = {}
    while full.has_unfinished():
        for o in full.step():
            out.setdefault(o.index, []).extend(o.new_token_ids)
    assert warm["tokens"] == cold["tokens"] == [out[i] for i in sorted(out)]


def test_say_when_compiling_warns_once_per_request_that_meets_a_compile(caplog):
    import numba
    from rawinfer.engine.warmup import say_when_compiling

    @numba.njit
    def fresh(x):
        return x * 3 + 1

    with caplog.at_level(logging.WARNING, logger="rawinfer"), say_when_compiling():
        assert fresh(2) == 7 and fresh(2.5) == 8.5           # two builds, one warning
    warnings = [r for r in caplog.records if "compiling a kernel" in r.getMessage()]
    assert len(warnings) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rawinfer"), say_when_compiling():
        fresh(4)                                             # built already: nothing to say
    assert not caplog.records


def test_one_shot_config_sizes_the_kv_region_for_its_request(tiny_llama_dir):
    from rawinfer.config import EngineConfig, ModelConfig
    from rawinfer.exec.memory import CPU_KV_CACHE_BYTES, kv_bytes_per_block
    from rawinfer.frontends.cli.models import one_shot_config
    model = ModelConfig.from_dir(tiny_llama_dir)
    cfg = EngineConfig(device="cpu", block_size=16)
    one = one_shot_config(cfg, tiny_llama_dir, 2)
    blocks = -(-model.max_position_embeddings // 16) * 2
    assert one.warmup is False
    assert one.kv_cache_memory == min(CPU_KV_CACHE_BYTES, blocks * kv_bytes_per_block(model, 16, "float32"))
    assert one_shot_config(EngineConfig(device="cpu", kv_cache_memory=1 << 20), tiny_llama_dir, 2).kv_cache_memory \
        == 1 << 20                                           # --kv-cache-memory is the user's
    assert one_shot_config(EngineConfig(device="cuda"), tiny_llama_dir, 1).kv_cache_memory is None


def test_the_one_shot_request_fits_its_kv_region(tiny_llama_dir):
    """The longest request the model allows, n samples of it, fits the region one_shot_config gives."""
    from rawinfer import LLMEngine, SamplingParams
    from rawinfer.config import EngineConfig
    from rawinfer.frontends.cli.models import one_shot_config
    cfg = one_shot_config(EngineConfig(device="cpu"), tiny_llama_dir, 2)
    engine = LLMEngine(tiny_llama_dir, cfg)
    longest = engine.max_model_len
    engine.add_request("r", [5] * (longest - 4), SamplingParams(max_tokens=4, n=2, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def _python(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env())
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_no_cuda_driver_means_no_cupy_import():
    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("this machine has a CUDA driver")
    except OSError:
        pass
    out = _python("import sys; from rawinfer.backend.select import cuda_usable; "
                  "print(cuda_usable(), 'cupy' in sys.modules)")
    assert out == "False False"


def test_a_float_model_loads_without_ml_dtypes(tiny_llama_dir):
    out = _python("import sys; from rawinfer import LLMEngine; "
                  f"e = LLMEngine({tiny_llama_dir!r}, device='cpu', kv_cache_memory='4MiB', warmup=False); "
                  "print('ml_dtypes' in sys.modules)")
    assert out == "False"


def test_main_and_open_engine_freeze_what_lives_as_long_as_the_process(tiny_llama_dir, capsys):
    from rawinfer.frontends.cli.main import build_parser, main
    from rawinfer.frontends.cli.models import open_engine
    gc.unfreeze()
    try:
        assert main(["models"]) == 0 and gc.get_freeze_count() > 0
        gc.unfreeze()
        args = build_parser("generate").parse_args(["generate", "--model", tiny_llama_dir, "--device", "cpu",
                                                    "--kv-cache-memory", "4MiB", "-q", "x"])
        open_engine(args, one_shot=1)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    capsys.readouterr()
