"""Engine options: a wrong value of any of them is one ValueError naming it, the warm-up fits any token
budget, and a pool too large for the machine names the share that can be made smaller."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import fields
from types import SimpleNamespace

import pytest

from conftest import ROOT
from rawinfer import LLM, LLMEngine, SamplingParams
from rawinfer.config import EngineConfig, ModelConfig
from rawinfer.exec.memory import alloc_arena, kv_region_bytes

GIB = 1024**3


# ---- EngineConfig.validate ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", [f.name for f in fields(EngineConfig)])
def test_every_option_refuses_a_value_of_the_wrong_type(name):
    with pytest.raises(ValueError, match=f"^engine option {name}=<object object at .*> is invalid: it must be "):
        EngineConfig(**{name: object()}).validate()


@pytest.mark.parametrize("name", ["block_size", "kv_cache_memory", "max_num_batched_tokens", "max_num_seqs",
                                  "max_model_len", "num_threads", "seed", "gpu_memory_utilization"])
def test_a_bool_is_no_number(name):
    with pytest.raises(ValueError, match=f"^engine option {name}=True is invalid: it must be "):
        EngineConfig(**{name: True}).validate()


@pytest.mark.parametrize("options, message", [
    ({"gpu_memory_utilization": "x"}, "gpu_memory_utilization='x' is invalid: it must be a number in (0, 1]"),
    ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization=nan is invalid"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization=1.5 is invalid"),
    ({"seed": "x"}, "seed='x' is invalid: it must be an integer in [0, 2**63)"),
    ({"seed": -1}, "seed=-1 is invalid"),
    ({"seed": 2**63}, f"seed={2**63} is invalid"),
    ({"kv_cache_memory": "0"}, "kv_cache_memory='0' is invalid: it must be a positive size such as 2GiB"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory='lots' is invalid"),
    ({"block_size": 1025}, "block_size=1025 is invalid: it must be an integer from 1 to 1024"),
    ({"device": ["cpu"]}, "device=['cpu'] is invalid: it must be one of auto, cpu, cuda"),
    ({"kv_cache_dtype": None}, "kv_cache_dtype=None is invalid: it must be one of auto, float32"),
    ({"enable_prefix_caching": 1}, "enable_prefix_caching=1 is invalid: it must be true or false"),
    ({"use_cuda_graphs": "no"}, "use_cuda_graphs='no' is invalid: it must be true or false"),
    ({"max_num_seqs": 2.0}, "max_num_seqs=2.0 is invalid: it must be a positive integer"),
])
def test_a_bad_value_is_one_sentence_naming_the_option(options, message):
    with pytest.raises(ValueError) as e:
        EngineConfig(**options).validate()
    assert str(e.value).startswith(f"engine option {message}")


def test_good_values_pass():
    cfg = EngineConfig(kv_cache_memory="2MiB", seed=2**63 - 1, gpu_memory_utilization=1, max_model_len=None,
                       num_threads=2, block_size=1024, cache_dir=None, max_num_batched_tokens=1).validate()
    assert cfg.kv_cache_memory == 2 * 1024**2


def test_the_entry_points_refuse_wrong_types(tiny_llama_dir):
    with pytest.raises(ValueError, match="^engine option block_size=True is invalid"):
        LLM(tiny_llama_dir, block_size=True)
    with pytest.raises(ValueError, match="^engine option max_model_len=True is invalid"):
        LLMEngine(tiny_llama_dir, max_model_len=True)
    with pytest.raises(ValueError, match="^engine option gpu_memory_utilization='x' is invalid"):
        LLM(tiny_llama_dir, gpu_memory_utilization="x")
    for path in (5, None, b"model"):
        with pytest.raises(ValueError, match=f"^model folder {path!r} is invalid: it must be a string path"):
            LLM(path)


# ---- warm-up under a tiny token budget --------------------------------------------------------------
@pytest.mark.parametrize("budget", [1, 2, 4])
def test_warm_up_fits_any_token_budget(tiny_llama_dir, budget):
    engine = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=budget,
                       max_num_seqs=4, num_threads=1)
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    tokens = [t for _ in range(20) if engine.has_unfinished() for o in engine.step() for t in o.new_token_ids]
    assert len(tokens) == 4
    assert engine.score([1, 2, 3, 4, 5], budget).shape == (5, engine.model_config.vocab_size)


def test_cli_generates_with_a_budget_of_two_tokens(tiny_llama_dir):
    r = subprocess.run([sys.executable, "-m", "rawinfer", "generate", "--model", tiny_llama_dir, "--token-ids",
                        "--device", "cpu", "--threads", "1", "--max-tokens", "4", "--max-num-batched-tokens", "2",
                        "--kv-cache-memory", "8MiB", "1 2 3"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) == 4 and "chunk_sizes" not in r.stderr


# ---- a pool too large: which flag makes it smaller ----------------------------------------------------
def _with_context(tiny_llama_dir, tmp_path, positions: int) -> str:
    dst = str(tmp_path / "long-context")
    shutil.copytree(tiny_llama_dir, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["max_position_embeddings"] = positions
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def test_a_huge_context_names_the_rope_table_and_max_model_len(tiny_llama_dir, tmp_path):
    positions = 2**40                     # a cos/sin table of 64 TiB for head_dim 16: no machine holds it
    model = _with_context(tiny_llama_dir, tmp_path, positions)
    with pytest.raises(ValueError) as e:
        LLMEngine(model, device="cpu", kv_cache_memory="8MiB", warmup=False)
    message = str(e.value)
    assert f"65536.0 GiB of RoPE cos/sin table for {positions} positions" in message
    assert "give a smaller --max-model-len" in message and "--kv-cache-memory" not in message.partition(";")[2]
    engine = LLMEngine(model, device="cpu", kv_cache_memory="8MiB", max_model_len=64, warmup=False)
    assert engine.max_model_len == 64 and ModelConfig.from_dir(model).max_position_embeddings == positions


class _FailingBackend:
    """A GPU backend whose allocation always fails: alloc_arena's message without touching memory."""
    capabilities = SimpleNamespace(on_gpu=True)

    def alloc_arena(self, nbytes):
        raise MemoryError(nbytes)


@pytest.mark.parametrize("kv, ws, rope, fix", [
    (GIB, 0, 128 * GIB, "give a smaller --max-model-len"),
    (GIB, 2 * GIB, 0, "give a smaller --max-num-batched-tokens or --max-num-seqs"),
    (8 * GIB, GIB, 4 * GIB, "give a smaller --kv-cache-memory"),
])
def test_alloc_arena_names_the_largest_share(kv, ws, rope, fix):
    with pytest.raises(ValueError) as e:
        alloc_arena(_FailingBackend(), kv + ws + rope + GIB, kv, "--kv-cache-memory", ws, rope, 2**31)
    message = str(e.value)
    assert fix in message.partition(";")[2]
    assert (f"GiB of RoPE cos/sin table for {2**31} positions" in message) == bool(rope)


def test_gpu_budget_names_the_rope_table_when_it_fills_it():
    ecfg = EngineConfig(gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match=r"\(90 MiB of it the RoPE cos/sin table\).*give a smaller --max-model-len"):
        kv_region_bytes(ecfg, 100 * 1024**2, 100 * 1024**2, rope_bytes=90 * 1024**2)
    with pytest.raises(ValueError, match="raise --gpu-memory-utilization"):
        kv_region_bytes(ecfg, 100 * 1024**2, 100 * 1024**2, rope_bytes=10 * 1024**2)


def test_engine_config_must_be_one_and_alone(tiny_llama_dir):
    with pytest.raises(ValueError, match="engine_config must be an EngineConfig.*got dict"):
        LLMEngine(tiny_llama_dir, engine_config={"device": "cpu"})
    with pytest.raises(ValueError, match=r"comes alone.*\['max_num_seqs'\]"):
        LLMEngine(tiny_llama_dir, engine_config=EngineConfig(device="cpu"), max_num_seqs=4)
