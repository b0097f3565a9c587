"""The model runner's decode-graph machinery, pool sizing and the sampler's device path, on the CPU.

- The pure pieces: graph buckets, the packed decode-input layout, the padded host arrays of one step,
  the KV sizing rule (explicit, CPU default, GPU share of free memory).
- The whole graph path end to end without a GPU: `CUDABackend` over the host kernel shim
  (tests/cuda_shim) with a launcher whose `capture` records every launch and GEMM with the arguments
  it had (arrays by address, scalars by value) instead of running it, and whose graphs replay that
  record, which is what a CUDA graph does.  Decoding with graphs must give the eager tokens, and a
  replay must equal an eager run of the same padded batch bit for bit.
- The sampler: device rows and host rows, one generator draw per sampled row, CPU unchanged.
"""

from __future__ import annotations

import argparse
import os
import warnings

import numpy as np
import pytest

from rawinfer import LLMEngine, SamplingParams
from rawinfer.backend.base import Capabilities
from rawinfer.backend.cpu.backend import CPUBackend
from rawinfer.backend.select import get_backend
from rawinfer.config import EngineConfig, ModelConfig
from rawinfer.core.step_plan import bucket_for, slot_mapping
from rawinfer.exec.graphs import build_decode_inputs, decode_input_words, decode_layout, graph_buckets
from rawinfer.exec.memory import CPU_KV_CACHE_BYTES, MemoryPool, kv_bytes_per_block, kv_region_bytes
from rawinfer.engine.sampler import Sampler, make_generator, sample_row

MIB = 1024**2
from conftest import DATA  # noqa: E402


# ---- buckets and the packed layout ------------------------------------------------------------------
def test_graph_buckets_and_bucket_choice():
    assert graph_buckets(1) == (1,)
    assert graph_buckets(8) == (1, 2, 4, 8)
    assert graph_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    buckets = graph_buckets(100)
    assert [bucket_for(b, buckets) for b in (1, 2, 3, 5, 64, 65, 100)] == [1, 2, 4, 8, 64, 100, 100]
    for bad in (0, 101):
        with pytest.raises(ValueError, match="bucket"):
            bucket_for(bad, buckets)
    with pytest.raises(ValueError):
        graph_buckets(0)


@pytest.mark.parametrize("bucket,max_blocks", [(1, 1), (4, 3), (64, 512)])
def test_decode_layout_tiles_the_region(bucket, max_blocks):
    layout = decode_layout(bucket, max_blocks)
    words = sorted((sl.start, sl.stop) for sl, _ in layout.values())
    assert words[0][0] == 0 and words[-1][1] == decode_input_words(bucket, max_blocks)
    assert all(a[1] == b[0] for a, b in zip(words, words[1:]))          # contiguous, no overlap
    for sl, shape in layout.values():
        assert sl.stop - sl.start == int(np.prod(shape))
    assert layout["block_tables"][1] == (bucket, max_blocks) and layout["query_start_loc"][1] == (bucket + 1,)


def unpack(buf, bucket, max_blocks):
    return {name: buf[sl].reshape(shape) for name, (sl, shape) in decode_layout(bucket, max_blocks).items()}


def test_build_decode_inputs_real_rows_and_padding():
    BS, MB, pad = 4, 5, 99
    tables = [[7, 3], [12], [5, 6, 8]]
    positions = [5, 0, 11]                  # last row: block 2 of its table (8), row 3
    slots = [slot_mapping(t, p, BS) for t, p in zip(tables, positions)]
    buf = build_decode_inputs([101, 102, 103], positions, slots, tables, [0, 2], bucket=8, max_blocks=MB,
                              block_size=BS, padding_block=pad)
    assert buf.dtype == np.int32 and buf.shape == (decode_input_words(8, MB),)
    f = unpack(buf, 8, MB)
    np.testing.assert_array_equal(f["token_ids"], [101, 102, 103, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(f["positions"], [5, 0, 11, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(f["slot_mapping"], [3 * BS + 1, 12 * BS + 0, 8 * BS + 3] + [pad * BS] * 5)
    np.testing.assert_array_equal(f["context_lens"], [6, 1, 12, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(f["query_start_loc"], np.arange(9))
    np.testing.assert_array_equal(f["logits_indices"], [0, 2, 2, 3, 4, 5, 6, 7])   # needed rows first
    np.testing.assert_array_equal(f["block_tables"][0], [7, 3, pad, pad, pad])
    np.testing.assert_array_equal(f["block_tables"][1], [12, pad, pad, pad, pad])
    np.testing.assert_array_equal(f["block_tables"][2], [5, 6, 8, pad, pad])
    assert (f["block_tables"][3:] == pad).all()


def test_build_decode_inputs_full_bucket_and_errors():
    buf = build_decode_inputs([1, 2], [0, 1], [64, 65], [[4], [4]], [0, 1], bucket=2, max_blocks=1, block_size=16,
                              padding_block=9)
    f = unpack(buf, 2, 1)
    np.testing.assert_array_equal(f["slot_mapping"], [64, 65])
    np.testing.assert_array_equal(f["logits_indices"], [0, 1])
    with pytest.raises(ValueError, match="bucket of 2"):
        build_decode_inputs([1, 2, 3], [0, 0, 0], [16, 16, 16], [[1], [1], [1]], [], 2, 1, 16, 9)
    with pytest.raises(ValueError, match="more than the 1"):
        build_decode_inputs([1], [0], [16], [[1, 2]], [0], 2, 1, 16, 9)


# ---- pool sizing ------------------------------------------------------------------------------------
def test_kv_region_bytes_rule():
    ecfg = EngineConfig(gpu_memory_utilization=0.5)
    assert kv_region_bytes(ecfg, 10 * MIB, None) == (CPU_KV_CACHE_BYTES, "the CPU default")
    kv, how = kv_region_bytes(ecfg, 10 * MIB, 100 * MIB)
    assert kv == 40 * MIB and "0.5" in how and "100 MiB free" in how
    assert kv_region_bytes(EngineConfig(kv_cache_memory=3 * MIB), 10 * MIB, 100 * MIB)[0] == 3 * MIB
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        kv_region_bytes(ecfg, 60 * MIB, 100 * MIB)


def tiny_config(**kw) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=160, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=1024)
    base.update(kw)
    return ModelConfig(**base)


class FakeGPU(CPUBackend):
    """A CPU backend that reports device memory, to exercise the GPU sizing path of the pool."""
    name = "cuda"
    capabilities = Capabilities(on_gpu=True)

    def device_memory_info(self):
        return 64 * MIB, 80 * MIB


def test_pool_sizes_kv_from_free_device_memory():
    cfg = tiny_config()
    pool = MemoryPool(cfg, EngineConfig(max_num_batched_tokens=64, max_num_seqs=8, gpu_memory_utilization=0.5),
                      FakeGPU())
    per_block = kv_bytes_per_block(cfg, 16, np.float32)
    budget = 32 * MIB
    assert pool.kv_bytes == (budget - pool.weight_bytes - pool.workspace_bytes) // per_block * per_block
    assert budget - per_block < pool.total_bytes <= budget
    assert "gpu_memory_utilization 0.5" in pool.describe()


def test_cpu_pool_defaults_to_1gib_and_reserves_nothing_for_graphs():
    pool = MemoryPool(tiny_config(), EngineConfig(max_num_batched_tokens=64, max_num_seqs=8), CPUBackend())
    assert pool.kv_bytes == CPU_KV_CACHE_BYTES
    assert pool.workspace.attention is None and pool.workspace.extra == {}
    assert pool.kv.padding_block is None and pool.kv.k[0].shape[0] == pool.kv.num_blocks


def test_cli_leaves_kv_cache_memory_to_the_device():
    from rawinfer.frontends.options import add_engine_args, engine_config_from_args
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args([])).kv_cache_memory is None
    assert engine_config_from_args(p.parse_args(["--kv-cache-memory", "2MiB"])).kv_cache_memory == 2 * MIB
    assert EngineConfig().validate().kv_cache_memory is None


# ---- the graph path on the host shim ----------------------------------------------------------------
harness = pytest.importorskip("cuda_shim.harness")
needs_shim = pytest.mark.skipif(harness.compiler() is None, reason="no host C++ compiler for the CUDA shim")


def shim_engine(monkeypatch, model_dir, libraries, graphs: bool) -> LLMEngine:
    """The CUDA engine on the host shim. The step's prefill follows the fixed token budget (itl_target_ms 0):
    the shim's step times say nothing about a GPU, and these tests count the steps of a known schedule."""
    from rawinfer.backend.cuda.backend import CUDABackend
    backend = CUDABackend(launcher=harness.CapturingShimLauncher(libraries))
    monkeypatch.setattr("rawinfer.engine.engine.get_backend", lambda *args, **kwargs: backend)
    return LLMEngine(model_dir, EngineConfig(device="cuda", kv_cache_memory=2 * MIB, max_num_batched_tokens=64,
                                             max_num_seqs=4, max_model_len=256, use_cuda_graphs=graphs,
                                             itl_target_ms=0))


@needs_shim
def test_decode_graphs_on_the_shim_match_eager(monkeypatch, tiny_llama_dir, shim_libraries,
                                                staggered_generation):
    prompts = {"a": [5, 6, 7], "b": list(range(20, 37)), "c": [300, 301, 9, 11, 40]}
    graphed = shim_engine(monkeypatch, tiny_llama_dir, shim_libraries, graphs=True)
    pool = graphed.pool
    assert pool.kv.padding_block == pool.kv.num_blocks == graphed.block_manager.num_blocks
    assert pool.kv.k[0].shape[0] == pool.kv.num_blocks + 1
    runner = graphed.runner
    assert runner.graphs is not None and runner.graphs.buckets == (1, 2, 4)

    # bit-for-bit: a replay equals an eager run of the same padded batch
    calls = []
    real_run = runner.graphs.run

    def spy(plan):
        logits = real_run(plan)
        calls.append(plan.num_seqs)
        if len(calls) == 3:      # the graph's inputs still hold this step: run it eagerly and compare
            flat = runner.graphs.flat_batch(bucket_for(plan.num_seqs, runner.graphs.buckets))
            graph_logits = np.array(logits)
            eager = graphed.model.forward(flat)[:len(logits)]
            np.testing.assert_array_equal(eager, graph_logits)
        return logits
    runner.graphs.run = spy
    got = staggered_generation(graphed, prompts, 6)
    assert runner.graphs.captured == (1, 2, 4) and graphed.backend._launcher.captures == 3
    assert sorted(set(calls)) == [1, 2, 3]        # the bit-for-bit check ran on bucket 4 with a padding row

    eager = shim_engine(monkeypatch, tiny_llama_dir, shim_libraries, graphs=False)
    assert eager.runner.graphs is None and eager.pool.kv.padding_block is None
    assert staggered_generation(eager, prompts, 6) == got
    monkeypatch.setattr("rawinfer.engine.engine.get_backend", get_backend)   # the real CPU backend, not the shim's
    cpu = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="2MiB", max_num_batched_tokens=64, max_num_seqs=4)
    assert cpu.backend.name == "cpu"
    assert staggered_generation(cpu, prompts, 6) == got


@needs_shim
def test_q4_models_are_refused_on_cuda(monkeypatch, tmp_path, shim_libraries):
    """int8 and fp8 models run on CUDA (tests/backend/test_cuda_int8.py); q4 ones are refused at start."""
    from rawinfer.convert import ConversionWarning, convert
    dst = str(tmp_path / "tiny-q4")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionWarning)
        convert(os.path.join(DATA, "tiny-llama"), dst, quant="q4", progress=False)
    with pytest.raises(ValueError, match="^q4 weight-only models run on the CPU backend; convert with --quant int8, "
                                         "with --quant fp8 or without --quant for --device cuda"):
        shim_engine(monkeypatch, dst, shim_libraries, graphs=True)


# ---- the sampler ------------------------------------------------------------------------------------
class CountingGenerator:
    """A generator wrapper that counts draws."""

    def __init__(self, seed, index):
        self.rng, self.draws = make_generator(seed, index), 0

    def random(self):
        self.draws += 1
        return self.rng.random()


@needs_shim
def test_sampler_uses_the_device_for_rows_without_penalty(shim_libraries):
    from rawinfer.backend.cuda.backend import CUDABackend
    backend = CUDABackend(launcher=harness.ShimLauncher(shim_libraries))
    seen = []
    real_sample = backend.sample
    backend.sample = lambda logits, *arrays: (seen.append([np.array(a) for a in arrays]), real_sample(logits, *arrays))[1]
    rng = np.random.default_rng(3)
    vocab = 96
    logits = (rng.standard_normal((6, vocab)) * 2.5).astype(np.float32)
    params = [SamplingParams(temperature=0),                                   # greedy: device, no draw
              SamplingParams(temperature=0.9, top_k=12, seed=1),               # device draw
              SamplingParams(temperature=1.1, top_p=0.8, min_p=0.02, seed=2),  # device draw
              SamplingParams(temperature=0.7, repetition_penalty=1.3, seed=3), # host draw
              SamplingParams(temperature=0, repetition_penalty=1.2),           # host greedy
              SamplingParams(temperature=1.0, top_k=10**6, seed=4)]            # top_k past V: keeps all
    hist = [[1], [2], [3], [4, 5, 6], [7, 8], [9]]
    gens = [CountingGenerator(11, i) for i in range(6)]
    got = Sampler(backend).sample(logits, params, hist, gens)
    assert [g.draws for g in gens] == [0, 1, 1, 1, 0, 1]       # one draw per sampled row, as on the host
    (temperature, top_k, top_p, min_p, uniform), = seen
    np.testing.assert_array_equal(temperature, np.float32([0, 0.9, 1.1, 0, 0, 1.0]))
    np.testing.assert_array_equal(top_k, [0, 12, 0, 0, 0, vocab])
    np.testing.assert_array_equal(top_p, np.float32([1, 1, 0.8, 1, 1, 1]))
    np.testing.assert_array_equal(min_p, np.float32([0, 0, 0.02, 0, 0, 0]))
    assert uniform[0] == uniform[3] == uniform[4] == 0 and (uniform[[1, 2, 5]] > 0).all()
    # the same tokens as the host rule with the same generators (no draw sits on a rounding boundary here)
    want = [sample_row(logits[i], params[i], hist[i], make_generator(11, i)) for i in range(6)]
    assert got == want
    # greedy-only batches take the argmax path and never call the device sampler
    greedy = Sampler(backend).sample(logits[:2], [params[0]] * 2, hist[:2], gens[:2])
    assert greedy == [int(np.argmax(logits[0])), int(np.argmax(logits[1]))]
    assert len(seen) == 1


def test_sampler_without_device_sampler_is_the_host_rule(tiny_llama_dir):
    """On the CPU every non-greedy row goes through sample_row with its own generator (as before)."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 64)).astype(np.float32) * 3
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=10, seed=1),
              SamplingParams(temperature=1.0, top_p=0.7, repetition_penalty=1.3),
              SamplingParams(temperature=0, repetition_penalty=1.5)]
    hist = [[1, 2], [3], [4, 5, 6], [7]]
    got = Sampler(CPUBackend()).sample(logits, params, hist, [make_generator(9, i) for i in range(4)])
    want = [sample_row(logits[i], params[i], hist[i], make_generator(9, i)) for i in range(4)]
    assert got == want


def test_sampling_survives_a_tiny_temperature_and_an_overflowing_penalty():
    """temperature 5e-324 once divided every logit into +-inf and inf - inf gave NaN probabilities (the
    last token every time); a repetition penalty of 1e-308 overflowed the penalized logits the same way.
    Now the best token wins (ties share), as greedy decoding would pick."""
    rng = np.random.default_rng(3)
    row = rng.standard_normal(1000).astype(np.float32)
    best = int(np.argmax(row))
    for temp in (5e-324, 1e-300, 1e-30):
        p = SamplingParams(temperature=temp, max_tokens=1)
        assert all(sample_row(row, p, [], make_generator(s, 0)) == best for s in range(5))
    history = [best, 7]
    row[7] = row[best]                                       # both positive and penalized: +inf, tied
    p = SamplingParams(temperature=1.0, repetition_penalty=1e-308, max_tokens=1)
    got = {sample_row(row, p, history, make_generator(s, 0)) for s in range(40)}
    assert got == {best, 7}
