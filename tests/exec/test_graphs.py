"""Decode graphs for every bucket (rawinfer/exec/graphs.py): the padding step they are captured on, all of
them captured by the first decode step, steady decode only replaying, and the memory they are charged.

The graph path runs without a GPU: `CUDABackend` over the host kernel shim (tests/cuda_shim) with a
launcher whose `capture` records every launch and GEMM (arrays by address, scalars by value) instead of
running it and whose graphs replay that record, which is what a CUDA graph does. The model is Gemma 3's
tiny checkpoint: sliding and full layers, two RoPE tables, q/k norms and sandwich norms, so the fused
ops and windowed attention run inside the graphs.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from rawinfer import LLMEngine
from rawinfer.backend.select import get_backend
from rawinfer.config import EngineConfig
from rawinfer.exec.graphs import REGION, build_decode_inputs, decode_layout, padding_decode_inputs

harness = pytest.importorskip("cuda_shim.harness")
needs_shim = pytest.mark.skipif(harness.compiler() is None, reason="no host C++ compiler for the CUDA shim")

from conftest import _convert_tiny, _staggered_generation  # noqa: E402

MIB = 1024**2


def fields(buf, bucket, max_blocks):
    return {name: buf[sl].reshape(shape) for name, (sl, shape) in decode_layout(bucket, max_blocks).items()}


def test_padding_step_reads_and_writes_only_the_padding_block():
    BS, MB, pad = 4, 3, 7
    f = fields(padding_decode_inputs(5, MB, BS, pad), 5, MB)
    assert (f["block_tables"] == pad).all() and (f["slot_mapping"] == pad * BS).all()
    assert (f["token_ids"] == 0).all() and (f["positions"] == 0).all() and (f["context_lens"] == 1).all()
    np.testing.assert_array_equal(f["query_start_loc"], np.arange(6))      # one query per row
    np.testing.assert_array_equal(f["logits_indices"], np.arange(5))
    # a real step's rows past its batch are exactly these padding rows
    real = fields(build_decode_inputs([3, 4], [5, 2], [9, 13], [[2, 1], [3]], [1], 5, MB, BS, pad), 5, MB)
    padding = fields(padding_decode_inputs(5, MB, BS, pad), 5, MB)
    for name in ("token_ids", "positions", "slot_mapping", "context_lens", "block_tables"):
        np.testing.assert_array_equal(real[name][2:], padding[name][2:])


GRAPH_MIB = 3   # what the backend below reports each capture to take beside the pool


def device_reporting_backend(launcher):
    """CUDABackend on the shim whose device_memory_info() reports GRAPH_MIB less free memory per captured
    graph, as a GPU's driver would, so the graphs' accounting has something to measure."""
    from rawinfer.backend.base import Capabilities
    from rawinfer.backend.cuda.backend import CUDABackend

    class Reporting(CUDABackend):
        def device_memory_info(self):
            return (1024 - GRAPH_MIB * launcher.captures) * MIB, 1024 * MIB
    backend = Reporting(launcher=launcher)
    backend.capabilities = Capabilities(on_gpu=True, graphs=True, device_sampling=True)
    return backend


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return _convert_tiny(tmp_path_factory, "tiny-gemma3")


def shim_engine(monkeypatch, model_dir, backend, graphs: bool) -> LLMEngine:
    monkeypatch.setattr("rawinfer.engine.engine.get_backend", lambda *args, **kwargs: backend)
    return LLMEngine(model_dir, EngineConfig(device="cuda", kv_cache_memory=2 * MIB, max_num_batched_tokens=16,
                                             max_num_seqs=6, max_model_len=128, use_cuda_graphs=graphs,
                                             itl_target_ms=0, warmup=False))


PROMPTS = {"a": [5, 6, 7], "b": list(range(20, 47)), "c": [300, 301, 9, 11, 40], "d": [8], "e": [2, 3]}


@needs_shim
def test_first_decode_step_captures_every_bucket_and_later_steps_only_replay(monkeypatch, caplog, gemma_dir):
    libraries = harness.build_all()
    launcher = harness.CapturingShimLauncher(libraries)
    engine = shim_engine(monkeypatch, gemma_dir, device_reporting_backend(launcher), graphs=True)
    graphs = engine.runner.graphs
    assert graphs.buckets == (1, 2, 4, 6) and graphs.captured == ()

    runs, eager_decodes, capturing = [], [], []
    real_run, real_hidden = graphs.run, engine.model.forward_hidden
    graphs.run = lambda plan: (runs.append(plan.num_seqs), real_run(plan))[1]
    real_capture = engine.backend.capture_graph
    engine.backend.capture_graph = lambda fn: (capturing.append(1), real_capture(fn), capturing.pop())[1]

    def forward_hidden(batch):       # a pure decode batch's forward pass outside a capture: eager
        if batch.max_query_len == 1 and not capturing:
            eager_decodes.append(batch.num_tokens)
        return real_hidden(batch)
    engine.model.forward_hidden = forward_hidden
    with caplog.at_level(logging.INFO, logger="rawinfer"):
        got = _staggered_generation(engine, PROMPTS, 4)

    assert graphs.captured == (1, 2, 4, 6) and launcher.captures == 4      # all at the first decode step
    assert len(set(runs)) >= 3 and launcher.replays == len(runs)       # decode batches of several sizes replayed
    assert eager_decodes == []
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode graphs:")]
    assert len(lines) == 1 and "batch sizes 1, 2, 4, 6 captured" in lines[0]

    # memory: the inputs region and one KV block of every layer's K and V in the pool, the graphs beside it
    kv = engine.pool.kv
    block = sum(int(c[kv.padding_block].nbytes) for c in kv.k + kv.v)
    assert block == 2 * engine.model.cfg.num_layers * int(np.prod(kv.k[0].shape[1:])) * kv.k[0].itemsize
    assert graphs.pool_bytes == engine.pool.workspace.extra[REGION].nbytes + block
    assert graphs.device_bytes == 4 * GRAPH_MIB * MIB and f"{4 * GRAPH_MIB:.1f} MiB of device memory" in lines[0]

    # the same tokens as eager CUDA steps and as the CPU backend
    eager = shim_engine(monkeypatch, gemma_dir, device_reporting_backend(harness.CapturingShimLauncher(libraries)),
                        graphs=False)
    assert eager.runner.graphs is None
    assert _staggered_generation(eager, PROMPTS, 4) == got
    monkeypatch.setattr("rawinfer.engine.engine.get_backend", get_backend)   # the real CPU backend, not the shim's
    cpu = LLMEngine(gemma_dir, device="cpu", kv_cache_memory="2MiB", max_num_batched_tokens=16, max_num_seqs=6,
                    max_model_len=128, warmup=False)
    assert cpu.backend.name == "cpu"
    assert _staggered_generation(cpu, PROMPTS, 4) == got


@needs_shim
def test_capture_all_is_idempotent_and_graph_for_still_captures_one_bucket(monkeypatch, gemma_dir):
    launcher = harness.CapturingShimLauncher(harness.build_all())
    engine = shim_engine(monkeypatch, gemma_dir, device_reporting_backend(launcher), graphs=True)
    graphs = engine.runner.graphs
    kv = engine.pool.kv
    before = [np.array(c[:kv.padding_block]) for c in kv.k + kv.v]
    host = padding_decode_inputs(2, graphs.max_blocks, graphs.block_size, graphs.padding_block)
    engine.backend.upload(graphs.region[:host.size], host)
    graphs.graph_for(2)                                       # one bucket, as tools/gpu_bench.py asks
    assert graphs.captured == (2,) and launcher.captures == 1 and graphs.device_bytes is None
    graphs.capture_all()
    assert graphs.captured == graphs.buckets and launcher.captures == len(graphs.buckets)
    assert graphs.device_bytes == (len(graphs.buckets) - 1) * GRAPH_MIB * MIB   # the ones capture_all took
    graphs.capture_all()
    assert launcher.captures == len(graphs.buckets)
    # the padding steps wrote nothing outside the padding block
    for c, old in zip(kv.k + kv.v, before):
        np.testing.assert_array_equal(np.asarray(c[:kv.padding_block]), old)


@needs_shim
def test_a_capture_out_of_device_memory_names_the_fix(monkeypatch, gemma_dir):
    launcher = harness.CapturingShimLauncher(harness.build_all())
    engine = shim_engine(monkeypatch, gemma_dir, device_reporting_backend(launcher), graphs=True)
    real_capture = launcher.capture

    def capture(fn):
        if launcher.captures == 2:       # the third bucket's graph does not fit beside the pool
            raise MemoryError("out of memory allocating 2097152 bytes")
        return real_capture(fn)
    launcher.capture = capture
    with pytest.raises(RuntimeError, match="decode graph of 4 rows ran out of device memory beside the pool .*"
                                           "lower --gpu-memory-utilization, or run with --no-cuda-graphs"):
        _staggered_generation(engine, {"a": [5, 6, 7]}, 2)
